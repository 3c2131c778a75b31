"""Taking an object apart into a skeleton and its tensors, and back (``skeleton.py``)."""

from __future__ import annotations

import pickle
from collections import OrderedDict

import pytest
import torch

from bucketddp.skeleton import from_bytes, join_tensors, split_tensors, to_bytes


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 3))
    base = torch.arange(12.0)
    sd = OrderedDict(w=weight, tied=weight, b=base[2:6], b_again=base[2:6], other=base[6:10])
    sd._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {
        "model": sd,
        "empty": [torch.empty(0), torch.empty(0)],
        "half": torch.ones(2, 2, dtype=torch.bfloat16).requires_grad_(),
        "sparse": torch.eye(3).to_sparse(),
        "numbers": (1, 2.5, "x", None),
    }


def test_split_shares_tied_views_and_keeps_everything_else() -> None:
    state = _state()
    skeleton, tensors, metas = split_tensors(state)
    # w and tied are one tensor, the two b views one; the empty ones stay distinct; the
    # sparse tensor's indices and values travel as dense tensors of their own.
    assert len(tensors) == 8
    assert [m.parameter for m in metas] == [True] + [False] * 7
    assert metas[5].requires_grad and metas[5].dtype == torch.bfloat16
    copies = [t.detach().clone() for t in tensors]
    back = join_tensors(skeleton, copies, metas)
    model = back["model"]
    assert isinstance(model, OrderedDict) and model._metadata == {"": {"version": 1}}
    assert isinstance(model["w"], torch.nn.Parameter) and model["w"] is model["tied"]
    assert model["b"] is model["b_again"] and torch.equal(model["other"], torch.arange(6.0, 10))
    assert back["empty"][0] is not back["empty"][1]
    assert back["half"].requires_grad and back["half"].dtype == torch.bfloat16
    assert torch.equal(back["sparse"].to_dense(), torch.eye(3))
    assert back["numbers"] == (1, 2.5, "x", None)


def test_a_skeleton_alone_does_not_load() -> None:
    skeleton, _, _ = split_tensors({"t": torch.zeros(2)})
    with pytest.raises(pickle.UnpicklingError, match="without its tensors"):
        pickle.loads(skeleton)


def test_bytes_round_trip_keeps_values_dtypes_and_sharing() -> None:
    state = _state()
    back = from_bytes(to_bytes(state))
    for name in ("w", "b", "other"):
        assert torch.equal(back["model"][name], state["model"][name])  # type: ignore[index]
    assert back["model"]["w"] is back["model"]["tied"]
    assert back["half"].dtype == torch.bfloat16 and torch.equal(back["half"], state["half"])
    assert [t.numel() for t in back["empty"]] == [0, 0]
    assert back["numbers"] == (1, 2.5, "x", None)
    # The bytes hold copies: changing the original afterwards changes nothing read back.
    t = torch.ones(3)
    data = to_bytes({"t": t})
    t.add_(1)
    assert torch.equal(from_bytes(data)["t"], torch.ones(3))
