"""bucketddp._compat: each fallback, called directly on real tensors and files on this torch
and Lightning, and which path they take (``dev.py compat`` runs these on every supported
release)."""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

import pytest
import torch

from bucketddp import _compat


def _bumped_in(make_context: object, tensors: tuple[torch.Tensor, ...]) -> list[int]:
    before = [t._version for t in tensors]
    with make_context(tensors):  # type: ignore[operator]
        for t in tensors:
            t.add_(1)  # an in-place write bumps the counter
        assert all(t._version > v for t, v in zip(tensors, before, strict=True))
    return [t._version - v for t, v in zip(tensors, before, strict=True)]


@pytest.mark.compat("engine")
@pytest.mark.parametrize("path", ["chosen", "fallback"])
def test_version_counters_are_restored_on_either_path(path: str) -> None:
    tensors = (torch.zeros(3), torch.ones(2, 2), torch.zeros(()))
    make = {
        "chosen": _compat.preserve_version_counters,
        "fallback": _compat._preserve_one_by_one,
    }[path]
    assert _bumped_in(make, tensors) == [0, 0, 0]
    assert [t.sum().item() for t in tensors] == [3.0, 8.0, 1.0]  # the writes stay


@pytest.mark.compat("engine")
def test_a_torch_that_takes_one_tensor_gets_the_fallback() -> None:
    # torch 2.5 and 2.6 take one tensor (the fallback), 2.10 and later the tuple.
    preserve = torch.autograd.grad_mode._unsafe_preserve_version_counter
    one_only = "tensor" in inspect.signature(preserve).parameters
    chosen = _compat.preserve_version_counters((torch.zeros(1), torch.zeros(1)))
    assert isinstance(chosen, contextlib.ExitStack) == one_only


@pytest.mark.compat("engine")
def test_this_torch_is_supported_and_the_check_names_the_release_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _compat.check_torch()  # import bucketddp ran it: this torch passes
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.4.1+cu121"))
    with pytest.raises(ImportError, match=r"needs torch 2\.5 or newer; this is torch 2\.4\.1"):
        _compat.check_torch()


@pytest.mark.compat("engine")
def test_storage_use_count_counts_the_tensors_on_a_storage() -> None:
    base = torch.zeros(8)
    alone = _compat.storage_use_count(base.untyped_storage())
    views = [base[:4], base.view(2, 4)]
    assert _compat.storage_use_count(base.untyped_storage()) == alone + len(views)
    del views
    assert _compat.storage_use_count(base.untyped_storage()) == alone


@pytest.mark.compat("engine")
def test_unflatten_views_are_the_slot_views_of_the_loop() -> None:
    """The one-call views (every parameter contiguous, none empty) are those the Python
    loop of ``slot_views`` makes: same shapes, strides and places on the same storage."""
    from bucketddp.reducer import storage

    params = [torch.zeros(3, 4), torch.zeros(()), torch.zeros(5), torch.zeros(2, 1, 3)]
    flat = torch.arange(40.0)  # longer than the parameters: a last bucket's row follows
    fast = _compat.unflatten_views(flat, params)
    offset, slow = 0, []
    for p in params:
        slow.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    for views in (fast, storage.slot_views(flat, params)):
        for a, b in zip(views, slow, strict=True):
            assert (a.shape, a.stride(), a.storage_offset()) == (
                b.shape,
                b.stride(),
                b.storage_offset(),
            )
            assert a.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    # A channels_last weight or an empty parameter takes the loop, which keeps its layout
    # and puts it on the bucket's storage.
    odd = [torch.zeros(2, 3, 2, 2).to(memory_format=torch.channels_last), torch.zeros(0, 4)]
    views = storage.slot_views(flat, [params[0], *odd])
    assert views[1].stride() == odd[0].stride()
    assert views[2].shape == (0, 4)
    assert views[2].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


@pytest.mark.compat("fabric")
def test_weights_only_is_handed_to_lightning_only_when_given(tmp_path: Path) -> None:
    plugins = pytest.importorskip("lightning.fabric.plugins")
    path = tmp_path / "state.pt"
    torch.save({"w": torch.ones(2)}, path)
    io = plugins.TorchCheckpointIO()
    # What every Lightning release takes, and all that 2.4 (no weights_only) is ever given.
    assert _compat.weights_only_kwargs(None) == {}
    loaded = io.load_checkpoint(path, **_compat.weights_only_kwargs(None))
    assert torch.equal(loaded["w"], torch.ones(2))
    if "weights_only" in inspect.signature(io.load_checkpoint).parameters:  # Lightning 2.5 on
        loaded = io.load_checkpoint(path, **_compat.weights_only_kwargs(True))
        assert torch.equal(loaded["w"], torch.ones(2))
