"""Communication hooks (register_comm_hook) against torch DDP with the same hook, on gloo."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import (
    default_hooks,
    post_localSGD_hook,
    powerSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from bf16 import bf16_allreduce_hook
from bucketddp import BucketDataParallel
from models import assert_weights, batch, build, train
from multirank import raised, run_ranks

TINY = {"bucket_cap_mb": 0.002, "first_bucket_mb": 0.0005}


def _sum_then_halve(state, bucket):  # type: ignore[no-untyped-def]
    """A hook written against the GradBucket interface: sum, then average in a callback.

    Unannotated: torch DDP refuses a ``bucket`` annotation other than ``dist.GradBucket``,
    and this module's annotations are strings.
    """
    assert len(bucket.gradients()) == len(bucket.parameters()) >= 1
    assert bucket.buffer().numel() == sum(g.numel() for g in bucket.gradients())
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] / dist.get_world_size())


def _powersgd() -> tuple[Any, Callable[..., Any]]:
    # Two plain all-reduce steps first (buckets are rebuilt after the first), then rank-1
    # compression with error feedback: a stateful hook that depends on bucket indices.
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
    )
    return state, powerSGD_hook.powerSGD_hook


def _local_sgd() -> tuple[Any, Callable[..., Any]]:
    # Averaged gradients for two steps, then each rank steps on its own gradients (the
    # model averaging of post-local SGD lives in the optimizer, not in the hook).
    state = post_localSGD_hook.PostLocalSGDState(
        process_group=None,
        subgroup=None,
        start_localSGD_iter=2,
        post_local_gradient_allreduce=False,
    )
    return state, post_localSGD_hook.post_localSGD_hook


HOOKS: dict[str, Callable[[], tuple[Any, Callable[..., Any]]]] = {
    "allreduce": lambda: (None, default_hooks.allreduce_hook),
    "fp16_compress": lambda: (None, default_hooks.fp16_compress_hook),
    "fp16_wrapper": lambda: (None, default_hooks.fp16_compress_wrapper(_sum_then_halve)),
    "custom": lambda: (None, _sum_then_halve),
    "powersgd": _powersgd,
    "post_local_sgd": _local_sgd,
}


def _skip_powersgd_where_cuda_is(hook: str) -> None:
    """torch's powerSGD_hook synchronizes the CUDA device of CPU buckets whenever a GPU is
    present, and raises there (torch DDP alike; seen with torch 2.11 on a GPU machine)."""
    if hook == "powersgd" and torch.cuda.is_available():
        pytest.skip("torch's powerSGD_hook fails on CPU tensors where CUDA is available")


def _hooked(system: Callable[..., nn.Module], hook: str, **opts: Any) -> Callable[..., Any]:
    def wrap(model: nn.Module) -> nn.Module:
        wrapped = system(model, **opts)
        wrapped.register_comm_hook(*HOOKS[hook]())  # type: ignore[operator]
        return wrapped

    return wrap


def _row_group(wrapped: BucketDataParallel) -> dict[str, Any]:
    """Where the wrapper's agreement row is all-reduced when it does not ride."""
    own = wrapped.process_group if wrapped.process_group is not None else dist.group.WORLD
    row = wrapped.reducer.launcher.row_group  # type: ignore[union-attr]
    return {
        "private": row is not own,
        "same_ranks": dist.get_process_group_ranks(row) == dist.get_process_group_ranks(own),
    }


def _compare(rank: int, world: int, hook: str, tiny: bool) -> dict[str, Any]:
    ours = train("mlp", _hooked(BucketDataParallel, hook, **(TINY if tiny else {})), rank, steps=5)
    theirs = train("mlp", _hooked(DDP, hook), rank, steps=5)
    plain = train("mlp", BucketDataParallel, rank, steps=5)
    return {
        "ours": ours["params"],
        "theirs": theirs["params"],
        "plain": plain["params"],
        "buckets": len(ours["wrapped"].bucket_plan),
        "collectives": ours["wrapped"].comm_stats.collectives,
        "row": _row_group(ours["wrapped"]),
    }


RIDES = {"allreduce", "fp16_compress", "powersgd"}
"""The hooks whose last bucket carries the agreement row (see ``launch.HookLauncher``):
torch's averaging hooks in the buffer, PowerSGD as one more 1-D gradient."""

ORDERED = {"fp16_wrapper", "custom", "powersgd"}
"""The hooks that may launch collectives from their callbacks (``launches_from_callbacks``):
their row goes on a private group with the wrapper's ranks."""

CASES = [(h, False) for h in HOOKS] + [(h, True) for h in HOOKS if h != "powersgd"]


@pytest.mark.parametrize(("hook", "tiny"), CASES)
def test_hook_gives_the_weights_of_torch_ddp_with_it(hook: str, tiny: bool) -> None:
    _skip_powersgd_where_cuda_is(hook)
    results = run_ranks(_compare, 2, hook, tiny, timeout=90)
    for rank, r in enumerate(results):
        assert_weights(r["ours"], r["theirs"], rank)
        if tiny:
            assert r["buckets"] > 2
        # One hook call per bucket, and the flags' own all-reduce, unless they rode in the
        # last bucket (torch's averaging hooks and PowerSGD, exact at this world size).
        assert r["collectives"] == r["buckets"] + (0 if hook in RIDES else 1)
        # An ordered hook's row has a group of its own, with the wrapper's ranks.
        assert r["row"] == {"private": hook in ORDERED, "same_ranks": True}
    # Compression (or local steps) changes the result: the hook was really used.
    if hook in ("fp16_compress", "powersgd", "post_local_sgd"):
        r = results[0]
        assert any(not torch.equal(r["ours"][n], r["plain"][n]) for n in r["plain"])


def _with_hook(
    system: Callable[..., nn.Module], hook: Callable[..., Any], **opts: Any
) -> Callable[..., Any]:
    def wrap(model: nn.Module) -> nn.Module:
        wrapped = system(model, **opts)
        wrapped.register_comm_hook(None, hook)  # type: ignore[operator]
        return wrapped

    return wrap


def _bf16(rank: int, world: int) -> dict[str, Any]:
    hook = default_hooks.bf16_compress_hook
    ours = train("mlp", _with_hook(BucketDataParallel, hook), rank, steps=5)
    theirs = train("mlp", _with_hook(DDP, bf16_allreduce_hook), rank, steps=5)
    plain = train("mlp", BucketDataParallel, rank, steps=5)
    refused = raised(lambda: DDP(build("mlp")).register_comm_hook(None, hook), TypeError)
    return {
        "ours": ours["params"],
        "theirs": theirs["params"],
        "plain": plain["params"],
        "refused": refused,
    }


def test_bf16_compress_hook_gives_the_weights_of_torch_ddp_with_its_arithmetic() -> None:
    # torch DDP refuses torch's bf16 hook by name without NCCL; with the same arithmetic
    # under another name it is the ground truth on gloo.
    results = run_ranks(_bf16, 2, timeout=90)
    for rank, r in enumerate(results):
        assert_weights(r["ours"], r["theirs"], rank)
        assert any(not torch.equal(r["ours"][n], r["plain"][n]) for n in r["plain"])
        if torch.version.cuda is None and torch.version.hip is None:
            assert "BF16 all reduce communication hook required" in r["refused"]


class _InOrder:
    """A hook's state for torch DDP, whose call for bucket k waits for bucket k-1's future.

    PowerSGD launches collectives from its futures' callbacks, on gloo's threads. torch DDP
    calls the next bucket's hook meanwhile, so its ranks can issue collectives in different
    orders: on gloo it fails with a size mismatch. Waiting makes it the ground truth.
    """

    def __init__(self, state: Any, hook: Callable[..., Any]) -> None:
        self.state, self.hook = state, hook
        self.previous: Any = None
        self.shapes: list[list[tuple[int, ...]]] = []


def _in_order(s, bucket):  # type: ignore[no-untyped-def]
    if bucket.index() > 0:
        s.previous.wait()
    s.shapes.append([tuple(p.shape) for p in bucket.parameters()])
    s.previous = s.hook(s.state, bucket)
    return s.previous


def _powersgd_buckets(rank: int, world: int) -> dict[str, Any]:
    # The same two buckets as torch DDP's after its rebuild (checked below).
    opts = {"bucket_cap_mb": 0.002, "first_bucket_mb": 0.002}
    ours = train("mlp", _hooked(BucketDataParallel, "powersgd", **opts), rank, steps=6)
    serial = _InOrder(*_powersgd())

    def theirs_wrap(model: nn.Module) -> nn.Module:
        wrapped = DDP(model, bucket_cap_mb=0.002)
        wrapped.register_comm_hook(serial, _in_order)
        return wrapped

    theirs = train("mlp", theirs_wrap, rank, steps=6)
    shape = {n: tuple(p.shape) for n, p in ours["params"].items()}
    plan = [[shape[n] for n in b.names] for b in ours["wrapped"].bucket_plan]
    return {
        "ours": ours["params"],
        "theirs": theirs["params"],
        "plan": plan,
        "torch": serial.shapes,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_with_several_buckets_keeps_one_collective_order(world: int) -> None:
    # Before bucket k's hook waited for bucket k-1's future, this hung on every run. The
    # agreement row rides in the last bucket's PowerSGD traffic, exact at 3 ranks too.
    _skip_powersgd_where_cuda_is("powersgd")
    for rank, r in enumerate(run_ranks(_powersgd_buckets, world, timeout=120)):
        assert len(r["plan"]) == 2
        assert r["torch"][-2:] == r["plan"]
        assert_weights(r["ours"], r["theirs"], rank)


def _powersgd_unused(rank: int, world: int) -> dict[str, Any]:
    def run(system: Callable[..., nn.Module], unused: bool) -> dict[str, torch.Tensor]:
        hooked = _hooked(system, "powersgd", find_unused_parameters=unused)
        return train("mlp", hooked, rank, steps=5)["params"]

    plain = train("mlp", BucketDataParallel, rank, steps=5)["params"]
    return {"ours": run(BucketDataParallel, True), "torch": run(DDP, False), "plain": plain}


def test_powersgd_with_find_unused_keeps_the_rebuilt_layout() -> None:
    # torch DDP keeps its first bucket layout under find_unused_parameters=True; bucketddp
    # rebuilds as always. PowerSGD draws its random matrices in bucket order, so bucketddp
    # with the flag matches torch DDP without it, bit for bit. (torch DDP with the flag is
    # no ground truth here: on gloo its used-parameter all-reduce races the hook's own
    # collectives, and it aborted with a collective mismatch in 7 of 12 runs.)
    _skip_powersgd_where_cuda_is("powersgd")
    for r in run_ranks(_powersgd_unused, 2, timeout=90):
        for name, want in r["torch"].items():
            assert torch.equal(r["ours"][name], want), name
        assert any(not torch.equal(r["ours"][n], r["plain"][n]) for n in r["plain"])


@pytest.mark.parametrize("hook", ["fp16_compress", "powersgd"])
def test_hook_runs_at_world_size_1_as_in_torch_ddp(hook: str) -> None:
    _skip_powersgd_where_cuda_is(hook)
    (r,) = run_ranks(_compare, 1, hook, False, timeout=60)
    for name, want in r["theirs"].items():
        torch.testing.assert_close(r["ours"][name], want, rtol=0, atol=1e-6, msg=name)
    # The hook changed the result on one rank too (torch DDP calls it there).
    assert any(not torch.equal(r["ours"][n], r["plain"][n]) for n in r["plain"])


def _bad_hook(state: Any, bucket: Any) -> Any:
    return bucket.buffer()  # a tensor, not a future


def _misuse(rank: int, world: int) -> dict[str, str]:
    said = {}
    model = BucketDataParallel(build("mlp"))
    model.register_comm_hook(None, _bad_hook)
    said["twice"] = raised(lambda: model.register_comm_hook(None, default_hooks.allreduce_hook))
    x, y = batch("mlp", 0, rank)
    said["not_a_future"] = raised(lambda: F.mse_loss(model(x), y).backward(), TypeError)
    return said


def _short_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """Returns a future holding a tensor of the wrong size."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(torch.zeros(10))
    return future


def _short_under_join(rank: int, world: int) -> str:
    model = BucketDataParallel(build("mlp"))
    model.register_comm_hook(None, _short_hook)

    def train() -> None:
        with model.join():  # rank 0 has no batch: it joins at once, shadowing rank 1's step
            if rank == 1:
                x, y = batch("mlp", 0, rank)
                F.mse_loss(model(x), y).backward()

    return raised(train)


def test_a_wrong_hook_result_raises_on_every_rank_under_join() -> None:
    # Before, the rank that had joined did not check its hooks' futures: it went on to the
    # flags' all-reduce alone while the training rank raised.
    for said in run_ranks(_short_under_join, 2, timeout=60):
        assert "its future holds a tensor of 10 elements" in said


def test_hook_misuse_is_named() -> None:
    for said in run_ranks(_misuse, 2, timeout=60):
        assert "can be called once per wrapper" in said["twice"]
        assert (
            "'_bad_hook' returned Tensor; it must return a torch.futures.Future"
            in (said["not_a_future"])
        )


class _Deferred:
    """A hook's state: each bucket's future is completed only when the last bucket's hook
    is called, so a bucket's hook runs before the previous bucket's future is done."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.futures.Future[torch.Tensor]]] = []
        self.earlier_done: list[list[bool]] = []


def _deferred(state, bucket):  # type: ignore[no-untyped-def]
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    state.earlier_done.append([f.done() for _, f in state.pending])
    state.pending.append((bucket.buffer(), future))
    if bucket.is_last():  # every bucket's hook was called: reduce them all, in bucket order
        for buffer, waiting in state.pending:
            dist.all_reduce(buffer)
            waiting.set_result(buffer.div_(dist.get_world_size()))
        state.pending.clear()
    return future


_deferred.launches_from_callbacks = False  # type: ignore[attr-defined]


def _unordered(rank: int, world: int) -> dict[str, Any]:
    state = _Deferred()

    def hooked(model: nn.Module) -> nn.Module:
        wrapped = BucketDataParallel(model, **TINY)
        wrapped.register_comm_hook(state, _deferred)
        return wrapped

    ours = train("mlp", hooked, rank, steps=3)
    theirs = train("mlp", _hooked(DDP, "allreduce"), rank, steps=3)
    return {"ours": ours["params"], "theirs": theirs["params"], "seen": state.earlier_done}


def test_a_hook_that_launches_only_when_called_runs_as_soon_as_its_bucket_is_full() -> None:
    # Declared to launch nothing from its callbacks, the hook of bucket k is called while
    # bucket k-1's future is still pending (an ordered hook would wait for it: here forever).
    for rank, r in enumerate(run_ranks(_unordered, 2, timeout=90)):
        assert_weights(r["ours"], r["theirs"], rank)
        later = [done for done in r["seen"] if done]
        assert later and not any(any(done) for done in later)


class _TwoHeads(nn.Module):
    """Rank 1 leaves ``b`` out of its loss: a parameter with no gradient on one rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.a(x)
        return out if dist.get_rank() == 1 else out + self.b(x)


def _missing_with(rank: int, world: int, hook: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = BucketDataParallel(_TwoHeads())
    model.register_comm_hook(*HOOKS[hook]())
    said = raised(lambda: model(torch.randn(3, 4)).sum().backward())
    riding = model.reducer.launcher.riding  # type: ignore[union-attr]
    return {"said": said, "riding": riding, "row": _row_group(model)}


@pytest.mark.parametrize(
    ("hook", "world"),
    [
        ("allreduce", 2),
        ("fp16_compress", 2),
        ("custom", 2),
        ("fp16_compress", 3),
        ("post_local_sgd", 2),
        ("powersgd", 2),
        ("powersgd", 3),
    ],
)
def test_a_parameter_missing_on_one_rank_raises_on_every_rank_with_a_hook(
    hook: str, world: int
) -> None:
    # With torch's averaging hooks and PowerSGD the agreement row rides in the last bucket,
    # and the hook averages it: the sum taken back must still name the parameter on every
    # rank. At 3 ranks the fp16 average of a flag (1/3) is inexact, and rounding brings it
    # back. A row that does not ride goes on a private group for an ordered hook (custom),
    # on the wrapper's for any other (post-local SGD).
    _skip_powersgd_where_cuda_is(hook)
    for r in run_ranks(_missing_with, world, hook, timeout=90):
        assert "parameters ['b.weight', 'b.bias'] received no gradient" in r["said"]
        assert r["riding"] is (hook in RIDES)
        assert r["row"] == {"private": hook in ORDERED, "same_ranks": True}


@pytest.mark.parametrize("hook", ["allreduce", "powersgd"])
def test_hook_at_three_ranks_gives_the_weights_of_torch_ddp(hook: str) -> None:
    # Three ranks: the flags riding in the last bucket average to thirds, which float32
    # cannot hold exactly; multiplied back and rounded, every step must still read "as
    # planned" (one collective per bucket) and match torch DDP, PowerSGD's row included.
    _skip_powersgd_where_cuda_is(hook)
    for rank, r in enumerate(run_ranks(_compare, 3, hook, False, timeout=120)):
        assert_weights(r["ours"], r["theirs"], rank)
        assert r["collectives"] == r["buckets"] + (0 if hook in RIDES else 1)
        assert r["row"] == {"private": hook in ORDERED, "same_ranks": True}


def _allreduce_inside(state, bucket):  # type: ignore[no-untyped-def]
    return default_hooks.allreduce_hook(state, bucket)  # the user's code around torch's


NATIVE = {
    "allreduce": (default_hooks.allreduce_hook, True),
    "fp16_compress": (default_hooks.fp16_compress_hook, True),
    "allreduce_inside": (_allreduce_inside, False),
}
"""Each hook, and whether bucketddp runs it itself (torch's averaging hooks, by identity:
``native_hooks.py``) rather than call it. (torch DDP refuses torch's bf16 hook on gloo; the
bf16 test below compares it with the same arithmetic under another name.)"""


def _torch_hook_calls(rank: int, world: int, hook: str) -> dict[str, Any]:
    """How often torch's averaging hooks ran in training under each wrapper with ``hook``.

    Counted by their code objects, whatever helpers a torch release splits them into (2.5
    has no ``_compress_hook``), on the training thread, where both wrappers call hooks."""
    codes = {
        getattr(default_hooks, name).__code__
        for name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook")
    }
    calls = {"n": 0}

    def count(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code in codes:
            calls["n"] += 1

    out: dict[str, Any] = {}
    for label, system in (("ours", BucketDataParallel), ("theirs", DDP)):
        calls["n"] = 0
        opts = TINY if system is BucketDataParallel else {}  # several buckets
        sys.setprofile(count)
        try:
            result = train("mlp", _with_hook(system, NATIVE[hook][0], **opts), rank, steps=3)
        finally:
            sys.setprofile(None)
        out[label] = result["params"]
        out[f"{label}_calls"] = calls["n"]
    return out


@pytest.mark.parametrize("hook", list(NATIVE))
def test_torchs_averaging_hooks_run_without_their_callbacks_and_give_the_same_weights(
    hook: str,
) -> None:
    # torch's allreduce_hook and fp16_compress_hook are run by bucketddp itself: the same
    # arithmetic, with no Python callback on gloo's thread. A hook built on them (a
    # wrapper, the user's own code) is still called, as torch DDP calls every hook.
    for rank, r in enumerate(run_ranks(_torch_hook_calls, 2, hook, timeout=90)):
        assert_weights(r["ours"], r["theirs"], rank)
        assert r["theirs_calls"] > 0  # torch DDP ran torch's code: the count works
        assert (r["ours_calls"] == 0) is NATIVE[hook][1]


class _SometimesTwoHeads(nn.Module):
    """Rank 1 leaves ``b`` out of its loss in steps 4 and 5, after PowerSGD has started to
    compress: steps in which the ranks' agreement rows differ."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        out = self.a(x)
        return out if dist.get_rank() == 1 and self.steps in (4, 5) else out + self.b(x)


def _powersgd_row(rank: int, world: int) -> dict[str, Any]:
    def run(hook: Callable[..., Any]) -> dict[str, Any]:
        torch.manual_seed(0)
        model = BucketDataParallel(_SometimesTwoHeads(), find_unused_parameters=True)
        state, _ = _powersgd()
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(rank)
        for _ in range(7):
            opt.zero_grad()
            model(torch.randn(5, 8, generator=data)).sum().backward()
            opt.step()
        params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        return {"params": params, "riding": model.reducer.launcher.riding}  # type: ignore[union-attr]

    def renamed(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        # torch's PowerSGD, not recognized as such: its row is all-reduced on its own.
        return powerSGD_hook.powerSGD_hook(state, bucket)

    return {"rides": run(powerSGD_hook.powerSGD_hook), "alone": run(renamed)}


def test_powersgd_carries_the_row_through_compressed_steps_where_the_ranks_differ() -> None:
    # The row rides in PowerSGD's last bucket as one more 1-D gradient. In steps 4 and 5
    # rank 1 has no gradient for ``b``: the rows differ, and the sum must still find that
    # ``b`` was used on rank 0 only (its gradient averaged over the ranks, as planned). The
    # weights equal those of the same training with the row all-reduced on its own, bit for
    # bit; the compressed updates of ``b`` are in both.
    _skip_powersgd_where_cuda_is("powersgd")
    for r in run_ranks(_powersgd_row, 2, timeout=90):
        assert r["rides"]["riding"] and not r["alone"]["riding"]
        for name, want in r["alone"]["params"].items():
            assert torch.equal(r["rides"]["params"][name], want), name
