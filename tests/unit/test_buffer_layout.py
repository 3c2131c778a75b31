"""The agreed buffer layout and the stand-ins for buffers that left it: no processes."""

from __future__ import annotations

import torch
from torch import nn

from bucketddp.buffers.layout import AgreedLayout, layout_text, synced_view


def custom(buf: torch.Tensor, group: object) -> None:
    return None


def test_a_buffer_that_changed_layout_is_replaced_by_a_stand_in() -> None:
    layout = AgreedLayout()
    kept, resized = torch.ones(3), torch.ones(2, dtype=torch.int64)
    layout.record({"kept": kept, "resized": resized, "gone": torch.ones(4)})
    assert not layout.changed
    now = [kept, torch.ones(5, dtype=torch.int64), None]
    fitted = layout.with_stand_ins(["kept", "resized", "gone"], now)
    assert fitted[0] is kept
    assert torch.equal(fitted[1], torch.zeros(2, dtype=torch.int64))
    assert torch.equal(fitted[2], torch.zeros(4))
    assert layout.departed == {"resized": "shape [5] int64", "gone": "None"}
    assert layout.changed
    # A "sum" group sends its baseline in place of the buffer: it adds nothing.
    baseline = {"resized": torch.full((2,), 7, dtype=torch.int64)}
    assert layout.with_stand_ins(["resized"], [None], baseline)[0] is baseline["resized"]
    assert layout.differs({"kept": kept, "resized": now[1], "new": kept}) == ["resized", "new"]
    layout.record({"kept": kept})
    assert not layout.changed and layout.departed == {}


def test_what_ranks_compare_is_each_synced_buffers_layout() -> None:
    net = nn.Module()
    net.register_buffer("a", torch.zeros(2, 3))
    net.register_buffer("b", torch.zeros(1))
    net.register_buffer("c", torch.zeros(1))
    owners = {n: (net, n) for n in ("a", "b", "c")}
    view = synced_view(owners, {"a": "mean", "b": "none", "c": custom})
    assert view == {"a": "shape [2, 3] float32", "c": f"custom policy {__name__}.custom"}
    assert layout_text(torch.Size([4]), torch.bfloat16) == "shape [4] bfloat16"
