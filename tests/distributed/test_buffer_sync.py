"""Buffer policies on real gloo process groups.

Each fixture starts one group of processes and runs several checks in it; the tests then
compare what every rank reports against a ground truth computed from all ranks' values.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

from bucketddp import BucketDataParallel
from bucketddp.buffers import policy_label
from multirank import run_ranks

TIMEOUT = 60.0


def collectives(prof: Any) -> list[str]:
    """The c10d collectives a profiler saw, one event per collective call."""
    return [e.name for e in prof.events() if e.name.startswith("c10d::")]


# ------------------------------------------------------------ each policy's semantics


def product_in_place(buf: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """A custom policy that edits the buffer and returns None."""
    dist.all_reduce(buf, op=dist.ReduceOp.PRODUCT, group=group)


def sum_of_squares(buf: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """A custom policy that returns the new value."""
    out = buf * buf
    dist.all_reduce(out, group=group)
    return out


SEMANTICS_RULES: dict[str, Any] = {
    "f_broadcast": "broadcast",
    "f_mean": "mean",
    "f_sum": "sum",
    "f_max": "max",
    "f_min": "min",
    "f_none": "none",
    "f_inplace": product_in_place,
    "f_returned": sum_of_squares,
    "n_sum": "sum",
    "n_*": "max",  # n_max and n_min, but not n_sum (exact name wins)
    "n_min": "min",
    "flag": "max",
}


class PolicyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        for name in SEMANTICS_RULES:
            if name.startswith("f_"):
                self.register_buffer(name, torch.zeros(2, 3))
        for name in ("n_sum", "n_max", "n_min"):
            self.register_buffer(name, torch.zeros(4, dtype=torch.long))
        self.register_buffer("flag", torch.zeros(3, dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _local_value(rank: int, index: int, buf: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + index)
    if buf.dtype == torch.bool:
        return torch.rand(buf.shape, generator=g) < 0.4
    # Small integers (stored as floats too), so sums and products are exact.
    return torch.randint(-4, 5, buf.shape, generator=g).to(buf.dtype)


def _semantics_worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = PolicyModel()
    ddp = BucketDataParallel(model, buffer_sync=SEMANTICS_RULES)
    local = {}
    with torch.no_grad():
        for i, (name, buf) in enumerate(model.named_buffers()):
            buf.copy_(_local_value(rank, i, buf))
            local[name] = buf.clone()
    first = ddp.sync_buffers()
    once = {n: b.clone() for n, b in model.named_buffers()}
    second = ddp.sync_buffers()
    twice = {n: b.clone() for n, b in model.named_buffers()}
    return {
        "local": local,
        "once": once,
        "twice": twice,
        "counts": (first, second),
        "policies": {n: policy_label(p) for n, p in ddp.buffers_sync.policies.items()},
    }


@pytest.fixture(scope="module")
def semantics() -> list[dict[str, Any]]:
    return run_ranks(_semantics_worker, 3, timeout=TIMEOUT)


def _ground_truth(name: str, policy: str, locals_: list[torch.Tensor], rank: int) -> torch.Tensor:
    stacked = torch.stack(locals_)
    if policy == "broadcast":
        return locals_[0]
    if policy == "mean":
        return stacked.sum(0) / len(locals_)
    if policy == "sum":  # every buffer started at zero, so the total is the ranks' sum
        return stacked.sum(0)
    if policy == "max":
        return stacked.amax(0)
    if policy == "min":
        return stacked.amin(0)
    if policy == "none":
        return locals_[rank]
    if policy.endswith("product_in_place"):
        return stacked.prod(0)
    if policy.endswith("sum_of_squares"):
        return (stacked * stacked).sum(0)
    raise AssertionError(f"no ground truth for {name}: {policy}")


def test_every_buffer_got_the_policy_its_rule_gives(semantics: list[dict[str, Any]]) -> None:
    policies = semantics[0]["policies"]
    assert policies["n_sum"] == "sum"
    assert policies["n_max"] == "max"
    assert policies["n_min"] == "min"
    assert policies["f_inplace"].endswith("product_in_place")
    assert all(r["policies"] == policies for r in semantics)


@pytest.mark.compat("buffers")
def test_each_policy_matches_ground_truth_from_all_ranks(semantics: list[dict[str, Any]]) -> None:
    policies = semantics[0]["policies"]
    for name, policy in policies.items():
        locals_ = [r["local"][name] for r in semantics]
        assert len({tuple(t.flatten().tolist()) for t in locals_}) > 1, f"{name}: ranks agree"
        for rank, result in enumerate(semantics):
            want = _ground_truth(name, policy, locals_, rank)
            got = result["once"][name]
            assert got.dtype == want.dtype or policy == "mean", name
            assert torch.equal(got, want), f"{name} ({policy}) on rank {rank}: {got} != {want}"


def test_reducing_policies_are_idempotent(semantics: list[dict[str, Any]]) -> None:
    policies = semantics[0]["policies"]
    for name, policy in policies.items():
        if policy in ("broadcast", "mean", "max", "min", "sum", "none"):
            for result in semantics:
                assert torch.equal(result["twice"][name], result["once"][name]), name


def _half_means(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = nn.Linear(2, 2)
    model.register_buffer("h", torch.zeros(3, dtype=torch.float16))
    model.register_buffer("b", torch.zeros(3, dtype=torch.bfloat16))
    ddp = BucketDataParallel(model, buffer_sync={"h": "mean", "b": "mean"})
    with torch.no_grad():  # the sums pass each dtype's largest value; the means do not
        model.h.fill_(40000.0 + 20000.0 * rank)
        model.b.fill_(2e38 + 1e38 * rank)
    ddp.sync_buffers()
    return {"h": model.h.clone(), "b": model.b.clone()}


class _Changing(nn.Module):
    """A model whose forward may reassign ``stat`` once, to ``resize_to``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("stat", torch.zeros(4))
        self.register_buffer("other", torch.zeros(3))
        self.resize_to: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.resize_to is not None:
            self.stat, self.resize_to = self.resize_to, None
        return self.lin(x)


def _train(ddp: nn.Module, steps: int, before: Any = None) -> tuple[str, int]:
    """Forward and backward ``steps`` times; returns the first error's message and its step."""
    for step in range(steps):
        if before is not None:
            before(step)
        try:
            ddp(torch.ones(1, 2)).sum().backward()
        except RuntimeError as e:
            return str(e), step
    return "no error", steps


def _changed_buffers(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # A buffer resized on rank 1 only, or on every rank alike, under each policy. "other"
    # shares the "mean" group with "stat", and must keep syncing.
    cases = [("mean", False), ("broadcast", False), ("sum", False)]
    for policy, alike in [*cases, ("mean", True), ("broadcast", True)]:
        model = _Changing()
        ddp = BucketDataParallel(model, buffer_sync={"stat": policy, "other": "mean"})

        def before(step: int, model: _Changing = model, alike: bool = alike) -> None:
            with torch.no_grad():
                model.other.fill_(rank + step)
            if step == 1 and (alike or rank == 1):
                model.resize_to = torch.full((6,), float(rank + 1))

        error, step = _train(ddp, 4, before)
        out[f"{policy} {alike}"] = (error, step, model.stat.clone(), model.other.clone())

    # A buffer set to None on every rank leaves the sync, as in torch DDP, and joins it
    # again when it gets a tensor back; set to None on one rank, it is an error everywhere.
    for everywhere in (True, False):
        model = _Changing()
        ddp = BucketDataParallel(model, buffer_sync={"stat": "mean"})
        ddp(torch.ones(1, 2)).sum().backward()
        if everywhere or rank == 1:
            model.stat = None  # allowed by torch: a None buffer
        error, _ = _train(ddp, 2)
        out[f"none {everywhere}"] = (error, sorted(ddp.buffers_sync.policies))
    model.stat = torch.full((2,), float(rank))
    out["none back"] = (_train(ddp, 2)[0], model.stat.clone())
    for none_at_wrap in (False, True):
        out[f"late {none_at_wrap}"] = _late_buffers(rank, none_at_wrap)
    out.update(_more_changes(rank))
    return out


def _halve(buf: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """A custom policy with a collective of its own: the mean of the ranks' values."""
    dist.all_reduce(buf, group=group)
    buf /= dist.get_world_size(group)


class _Counting(nn.Module):
    """A "sum" counter registered as None, given a tensor in the first forward, then added to."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("kept", torch.zeros(2))
        self.register_buffer("count", None)  # a rule may name it before it holds a tensor
        self.counting = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.counting:
            pass
        elif self.count is None:
            self.count = torch.full((), float(len(x)))
        else:
            self.count += len(x)
        return self.lin(x)


def _more_changes(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # A "sum" buffer registered after wrapping counts every rank's additions: ground truth
    # 4 steps of 2 + 3 samples. Then it leaves the sync, and a load still works.
    model = _Counting()
    ddp = BucketDataParallel(model, buffer_sync={"count": "sum"})
    for _ in range(4):
        ddp(torch.ones(2 + rank, 2)).sum().backward()
    ddp.sync_buffers()
    out["sum joins"] = model.count.clone()
    saved = model.state_dict()
    model.counting, model.count = False, None
    _train(ddp, 2)
    model.load_state_dict(saved, strict=False)
    out["sum leaves"] = sorted(ddp.buffers_sync.policies)
    # A buffer with a custom policy set to None on every rank leaves the sync too.
    model = _Changing()
    ddp = BucketDataParallel(model, buffer_sync={"stat": _halve})
    model.stat = None
    out["custom none"] = (_train(ddp, 2)[0], sorted(ddp.buffers_sync.policies))
    # A buffer given other memory in place keeps syncing: ground truth, rank 0's value.
    model = _Changing()
    ddp = BucketDataParallel(model)
    ddp(torch.ones(1, 2)).sum().backward()
    model.stat.data = torch.full((4,), float(rank + 1))
    ddp(torch.ones(1, 2)).sum().backward()
    out["data assigned"] = model.stat.clone()
    return out


class _LateBuffer(nn.Module):
    """A model that gains a buffer after wrapping: registered in its first forward, or
    registered as None before wrapping and given a tensor there."""

    def __init__(self, none_at_wrap: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.register_buffer("steps", torch.zeros(()))  # torch DDP syncs only if it has some
        if none_at_wrap:
            self.register_buffer("late", None)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        late = getattr(self, "late", None)
        if late is not None:
            self.seen.append(late.clone())  # as the forward found it, after the sync
        out = self.lin(x)
        stat = out.detach().mean(0)  # differs between ranks
        if late is None:
            self.register_buffer("late", stat)
        else:
            self.late = 0.5 * late + stat
        return out + self.late


def _late_buffers(rank: int, none_at_wrap: bool) -> dict[str, Any]:
    out = {}
    for kind in ("torch", "ours"):
        torch.manual_seed(0)
        model = _LateBuffer(none_at_wrap)
        wrap = DistributedDataParallel if kind == "torch" else BucketDataParallel
        ddp = wrap(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(4):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
        out[kind] = (model.seen, model.lin.weight.detach().clone())
    return out


@pytest.fixture(scope="module")
def changed() -> list[dict[str, Any]]:
    return run_ranks(_changed_buffers, 2, timeout=TIMEOUT)


@pytest.mark.parametrize("policy", ["mean", "broadcast", "sum"])
def test_a_buffer_resized_on_one_rank_is_an_error_on_every_rank(
    changed: list[dict[str, Any]], policy: str
) -> None:
    # Before, "mean" aborted gloo (a collective size mismatch) and "broadcast" left the
    # ranks unequal. Ground truth for "other": the mean of the ranks' values at that step.
    for result in changed:
        error, step, _, other = result[f"{policy} False"]
        assert "buffer 'stat' changed after the model was wrapped, and not alike" in error
        assert "shape [4] float32 on ranks [0]; shape [6] float32 on ranks [1]" in error
        assert "buffer_sync={'stat': 'none'}" in error
        assert torch.equal(other, torch.full((3,), 0.5 + step))


@pytest.mark.parametrize(("policy", "value"), [("mean", 1.5), ("broadcast", 1.0)])
def test_a_buffer_resized_alike_on_every_rank_syncs_in_its_new_shape(
    changed: list[dict[str, Any]], policy: str, value: float
) -> None:
    # Ground truth: the mean of the ranks' new values (1 and 2), or rank 0's.
    for result in changed:
        error, step, stat, other = result[f"{policy} True"]
        assert (error, step) == ("no error", 4)
        assert torch.equal(stat, torch.full((6,), value))
        assert torch.equal(other, torch.full((3,), 3.5))


def test_a_buffer_set_to_none_leaves_the_sync_and_comes_back(
    changed: list[dict[str, Any]],
) -> None:
    for result in changed:
        assert result["none True"] == ("no error", ["other"])
        error, _ = result["none False"]
        assert "buffer 'stat' changed after the model was wrapped" in error
        assert "shape [4] float32 on ranks [0]; absent or None on ranks [1]" in error
        error, stat = result["none back"]
        assert error == "no error" and torch.equal(stat, torch.full((2,), 0.5))


def test_mean_of_half_precision_buffers_does_not_overflow() -> None:
    # Before, the float16 sum overflowed: inf on every rank.
    for result in run_ranks(_half_means, 2, timeout=TIMEOUT):
        assert torch.equal(result["h"], torch.full((3,), 50000.0, dtype=torch.float16))
        assert torch.equal(result["b"], torch.full((3,), 2.5e38, dtype=torch.bfloat16))


def test_sync_reports_one_collective_per_group(semantics: list[dict[str, Any]]) -> None:
    # float: broadcast, mean, sum, max, min; long: sum, max, min; bool: max. The custom
    # functions' own collectives are not counted.
    assert {r["counts"] for r in semantics} == {(9, 9)}


# ---------------------------------------------------- "sum": many syncs and resumes

K = (1, 5)  # what each rank adds per training forward


class Counter(nn.Module):
    """Counts positives and negatives seen in training, as a class-weighted loss needs."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.lin = nn.Linear(4, 1)
        self.register_buffer("pos", torch.zeros((), dtype=torch.long))
        self.register_buffer("neg", torch.zeros((), dtype=torch.long))
        self.register_buffer("mass", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.pos.add_(self.k)
            # Reassigning the attribute (a new tensor) must be tracked as well.
            self.neg = self.neg + 2 * self.k
            self.mass.add_(torch.tensor([float(self.k), 0.5]))
        return self.lin(x)


SUM_RULES = {"pos": "sum", "neg": "sum", "mass": "sum"}


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _expected(adds: int, world: int) -> tuple[int, int, list[float]]:
    total = sum(K[:world])
    return adds * total, 2 * adds * total, [float(adds * total), 0.5 * adds * world]


def _read(model: nn.Module) -> tuple[int, int, list[float]]:
    return int(model.pos), int(model.neg), model.mass.tolist()


class Loop:
    """Trains a wrapped Counter, counting the training forwards (each adds k per rank)."""

    def __init__(self, ddp: BucketDataParallel, rank: int, adds: int = 0) -> None:
        self.ddp = ddp
        self.rank = rank
        self.adds = adds
        self.opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        self.seen: list[tuple[int, tuple[int, int, list[float]]]] = []

    def step(self, step: int) -> None:
        x = _batch(step, self.rank)
        self.ddp(x).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad()
        self.adds += 1
        if step % 3 == 0:  # several explicit syncs in a row
            for _ in range(3):
                self.sync()
        if step % 4 == 1:  # evaluation forwards under no_grad
            self.ddp.eval()
            with torch.no_grad():
                self.ddp(x)
                self.ddp(x)
            self.ddp.train()
        if step % 4 == 3:  # a training-mode forward under no_grad still counts
            with torch.no_grad():
                self.ddp(x)
            self.adds += 1
        if step % 5 == 2:  # gradient accumulation: a forward without a gradient sync
            with self.ddp.no_sync():
                self.ddp(x).sum().backward()
            self.adds += 1
            self.ddp(x).sum().backward()
            self.adds += 1
            self.opt.zero_grad()

    def sync(self) -> tuple[int, int, list[float]]:
        self.ddp.sync_buffers()
        value = _read(self.ddp.module)
        self.seen.append((self.adds, value))
        return value


def _sum_worker(rank: int, world: int, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    loop = Loop(BucketDataParallel(Counter(K[rank]), buffer_sync=SUM_RULES), rank)
    for step in range(9):
        loop.step(step)
    loop.sync()
    saved_adds = loop.adds
    if rank == 0:
        torch.save(loop.ddp.module.state_dict(), path)
    dist.barrier()
    for step in range(9, 12):  # move past the checkpoint, then go back to it
        loop.step(step)
    out["before_load"] = loop.sync()

    # 1. Load into the running wrapper, keys with the wrapper's "module." prefix: no
    # reset_baseline() call needed.
    state = torch.load(path)
    loop.ddp.load_state_dict({f"module.{k}": v for k, v in state.items()})
    loop.adds = saved_adds
    for step in range(12, 17):
        loop.step(step)
    out["reloaded"] = (loop.adds, loop.sync())

    # 2. A fresh model loaded from the checkpoint and wrapped anew.
    torch.manual_seed(1)
    fresh = Counter(K[rank])
    fresh.load_state_dict(torch.load(path))
    loop2 = Loop(BucketDataParallel(fresh, buffer_sync=SUM_RULES), rank, adds=saved_adds)
    for step in range(17, 23):
        loop2.step(step)
    out["rewrapped"] = (loop2.adds, loop2.sync())

    # 3. A partial load that leaves "pos" alone keeps this rank's unsynced additions.
    ddp = loop2.ddp
    ddp.train()
    ddp(_batch(99, rank)).sum().backward()  # adds k, not yet synced
    loop2.adds += 1
    ddp.module.load_state_dict({"lin.weight": ddp.module.lin.weight.detach().clone()}, strict=False)
    out["partial"] = (loop2.adds, loop2.sync())

    out["seen"] = loop.seen + loop2.seen
    out["saved_adds"] = saved_adds
    return out


def _resume_worker(rank: int, world: int, path: str, saved_adds: int) -> tuple[int, Any]:
    model = Counter(K[rank])
    model.load_state_dict(torch.load(path))
    loop = Loop(BucketDataParallel(model, buffer_sync=SUM_RULES), rank, adds=saved_adds)
    for step in range(30, 36):
        loop.step(step)
    return loop.adds, loop.sync()


@pytest.fixture(scope="module")
def sum_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = str(tmp_path_factory.mktemp("ckpt") / "counter.pt")
    ranks = run_ranks(_sum_worker, 2, path, timeout=TIMEOUT)
    resumed = run_ranks(_resume_worker, 2, path, ranks[0]["saved_adds"], timeout=TIMEOUT)
    return {"ranks": ranks, "resumed": resumed, "path": path}


def test_sum_reads_global_total_after_every_sync(sum_run: dict[str, Any]) -> None:
    for rank_result in sum_run["ranks"]:
        seen = rank_result["seen"]
        assert len(seen) > 15
        for adds, value in seen:
            assert value == _expected(adds, 2), f"after {adds} additions"


def test_sum_checkpoint_holds_the_agreed_total(sum_run: dict[str, Any]) -> None:
    state = torch.load(sum_run["path"])
    saved = sum_run["ranks"][0]["saved_adds"]
    assert (int(state["pos"]), int(state["neg"]), state["mass"].tolist()) == _expected(saved, 2)


def test_sum_is_exact_after_loading_into_the_running_wrapper(sum_run: dict[str, Any]) -> None:
    for r in sum_run["ranks"]:
        adds, value = r["reloaded"]
        assert value == _expected(adds, 2)


def test_sum_is_exact_after_rewrapping_a_loaded_model(sum_run: dict[str, Any]) -> None:
    for r in sum_run["ranks"]:
        adds, value = r["rewrapped"]
        assert value == _expected(adds, 2)


def test_sum_is_exact_after_resuming_in_new_processes(sum_run: dict[str, Any]) -> None:
    for adds, value in sum_run["resumed"]:
        assert adds > sum_run["ranks"][0]["saved_adds"]
        assert value == _expected(adds, 2)


def test_partial_load_keeps_unsynced_additions(sum_run: dict[str, Any]) -> None:
    for r in sum_run["ranks"]:
        adds, value = r["partial"]
        assert value == _expected(adds, 2)


# ------------------------------------------------------------ coalescing and counts


class ManyBuffers(nn.Module):
    """Six float buffers (mean), two long ones (sum), three kept per rank (none)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        for i, shape in enumerate([(4,), (2, 3), (), (5,), (1, 1), (7,)]):
            self.register_buffer(f"ema{i}", torch.zeros(shape))
        self.register_buffer("count0", torch.zeros((), dtype=torch.long))
        self.register_buffer("count1", torch.zeros(3, dtype=torch.long))
        self.register_buffer("seed", torch.zeros((), dtype=torch.long))
        self.register_buffer("noise", torch.zeros(3))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(),
            nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(),
            nn.Linear(8, 3), nn.BatchNorm1d(3),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _count_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rules = {"ema*": "mean", "count*": "sum", "seed": "none", "noise": "none", "steps": "none"}
    ddp = BucketDataParallel(ManyBuffers(), buffer_sync=rules)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out["returned"] = ddp.sync_buffers()
    out["profiled"] = collectives(prof)
    out["groups"] = [(g.policy, str(g.dtype), len(g.names)) for g in ddp.buffers_sync.groups]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ddp(torch.randn(2, 4))  # the first training forward syncs the buffers
    out["forward"] = collectives(prof)

    # The default (broadcast) on three BatchNorm layers: nine buffers, two dtypes.
    bn = BucketDataParallel(BNNet())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out["bn_returned"] = bn.sync_buffers()
    out["bn_profiled"] = collectives(prof)
    return out


@pytest.fixture(scope="module")
def counts() -> list[dict[str, Any]]:
    return run_ranks(_count_worker, 2, timeout=TIMEOUT)


def test_one_collective_per_policy_and_dtype_group(counts: list[dict[str, Any]]) -> None:
    for r in counts:
        assert r["groups"] == [("mean", "torch.float32", 6), ("sum", "torch.int64", 2)]
        assert r["profiled"] == ["c10d::allreduce_", "c10d::allreduce_"]
        assert r["returned"] == 2


def test_forward_sync_is_coalesced_too(counts: list[dict[str, Any]]) -> None:
    for r in counts:
        assert r["forward"] == ["c10d::allreduce_", "c10d::allreduce_"]


def test_default_broadcast_is_one_collective_for_all_dtypes(
    counts: list[dict[str, Any]],
) -> None:
    # float32 statistics and int64 counters travel as bytes in a single broadcast.
    for r in counts:
        assert r["bn_profiled"] == ["c10d::broadcast_"]
        assert r["bn_returned"] == 1


# ----------------------------------------------------------------- errors at setup


class Configured(nn.Module):
    """Declares its own rules, as a LightningModule's configure_buffer_sync does."""

    def __init__(self, hook_rules: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.hook_rules = hook_rules or {}
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("pos", torch.zeros((), dtype=torch.long))
        self.register_buffer("seed", torch.zeros((), dtype=torch.long))
        self.norm = LocalStats()
        self.other = LocalStats()

    def configure_buffer_sync(self) -> dict[str, Any]:
        return self.hook_rules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class LocalStats(nn.Module):
    """Stands in for SyncBatchNorm: its statistics are already global."""

    default_buffer_policy = "none"

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(4))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))


def _try(**kwargs: Any) -> tuple[str, str] | None:
    hook_rules = kwargs.pop("hook_rules", None)
    try:
        BucketDataParallel(Configured(hook_rules), **kwargs)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def _error_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "unknown": _try(buffer_sync={"ema": "average"}),
        "unknown_in_hook": _try(hook_rules={"norm.*": "avg"}),
        "no_match_pattern": _try(buffer_sync={"encoder.*": "mean"}),
        "no_match_name": _try(hook_rules={"emma": "mean"}),
        "mean_on_int": _try(buffer_sync={"pos": "mean"}),
        "mean_on_int_default": _try(default_buffer_policy="mean"),
        "not_callable": _try(buffer_sync={"ema": 3}),
        "not_a_mapping": _try(buffer_sync="mean"),
        "hook_not_a_mapping": _try(hook_rules=["ema"]),
        "rank_differs": _try(buffer_sync={"ema": "mean" if rank == 0 else "max"}),
        "one_rank_fails": _try(buffer_sync={"ema": "mean"} if rank == 0 else {"emma": "mean"}),
    }
    # After all that, the ranks are still in step: a good setup and a sync work.
    ddp = BucketDataParallel(Configured({"ema": "mean"}), buffer_sync={"pos": "sum"})
    out["after"] = ddp.sync_buffers()
    return out


@pytest.fixture(scope="module")
def errors() -> list[dict[str, Any]]:
    return run_ranks(_error_worker, 2, timeout=TIMEOUT)


@pytest.mark.parametrize(
    "case, kind, words",
    [
        ("unknown", "ValueError", ["'average'", "'ema'", "buffer_sync"]),
        ("unknown_in_hook", "ValueError", ["'avg'", "'norm.*'", "configure_buffer_sync"]),
        ("no_match_pattern", "ValueError", ["'encoder.*'", "matches no buffer"]),
        ("no_match_name", "ValueError", ["'emma'", "matches no buffer", "configure_buffer_sync"]),
        ("mean_on_int", "ValueError", ["'pos'", "torch.int64", "mean"]),
        ("mean_on_int_default", "ValueError", ["'pos'", "mean"]),
        ("not_callable", "TypeError", ["'ema'", "int", "callable"]),
        ("not_a_mapping", "TypeError", ["buffer_sync is a str ('mean')", "use a dict"]),
        ("hook_not_a_mapping", "TypeError", ["configure_buffer_sync() returned a list"]),
        ("rank_differs", "RuntimeError", ["different buffer policies", "'ema'", "rank 1"]),
    ],
)
def test_setup_error_on_every_rank_names_the_culprit(
    errors: list[dict[str, Any]], case: str, kind: str, words: list[str]
) -> None:
    for rank, result in enumerate(errors):
        assert result[case] is not None, f"rank {rank} raised nothing for {case}"
        got_kind, message = result[case]
        assert got_kind == kind, message
        for word in words:
            assert word in message, f"rank {rank}: {word!r} not in {message!r}"


def test_an_error_on_one_rank_is_raised_on_all(errors: list[dict[str, Any]]) -> None:
    kind0, message0 = errors[0]["one_rank_fails"]
    kind1, message1 = errors[1]["one_rank_fails"]
    assert kind0 == kind1 == "ValueError"
    assert "on rank 1" in message0 and "'emma'" in message0
    assert "'emma'" in message1


def test_ranks_stay_in_step_after_setup_errors(errors: list[dict[str, Any]]) -> None:
    # ema (float mean), pos (long sum), seed (long broadcast); norm.* and other.* are none.
    assert [r["after"] for r in errors] == [3, 3]


# -------------------------------------------- configuration sources, "none" at setup


def _config_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = Configured({"ema": "mean", "pos": "max", "seed": "none", "other.*": "broadcast"})
    with torch.no_grad():  # per-rank values set before wrapping
        for buf in model.buffers():
            buf.fill_(rank + 1)
    ddp = BucketDataParallel(model, buffer_sync={"pos": "sum"})
    out["policies"] = {n: policy_label(p) for n, p in ddp.buffers_sync.policies.items()}
    out["after_wrap"] = {n: b.clone() for n, b in model.named_buffers()}
    from_rank0 = {id(b) for b in ddp.buffers_sync.buffers_from_rank0()}
    out["from_rank0"] = [n for n, b in model.named_buffers() if id(b) in from_rank0]
    out["rank_local"] = ddp.buffers_sync.rank_local
    return out


@pytest.fixture(scope="module")
def config() -> list[dict[str, Any]]:
    return run_ranks(_config_worker, 2, timeout=TIMEOUT)


def test_module_hook_wrapper_argument_and_module_defaults_combine(
    config: list[dict[str, Any]],
) -> None:
    assert config[0]["policies"] == {
        "ema": "mean",  # the module's hook
        "pos": "sum",  # the wrapper's argument beats the hook's "max"
        "seed": "none",
        "norm.running": "none",  # the submodule's own default
        "norm.seen": "none",
        "other.running": "broadcast",  # the hook's pattern beats the submodule's default
        "other.seen": "broadcast",
    }


def test_only_explicit_none_buffers_are_rank_local(config: list[dict[str, Any]]) -> None:
    for r in config:
        assert r["rank_local"] == {"seed"}
        assert "seed" not in r["from_rank0"]
        assert len(r["from_rank0"]) == len(r["policies"]) - 1


def test_buffers_start_from_rank_0(config: list[dict[str, Any]]) -> None:
    # A module's own "none" (SyncBatchNorm's) still starts from rank 0's value.
    for name in ("ema", "pos", "norm.running", "norm.seen", "other.running", "other.seen"):
        assert [int(r["after_wrap"][name].flatten()[0]) for r in config] == [1, 1], name


def test_rank_local_buffers_keep_their_value_through_wrapping(
    config: list[dict[str, Any]],
) -> None:
    assert [int(r["after_wrap"]["seed"]) for r in config] == [1, 2]


# --------------------------------------------- default "broadcast" equals torch DDP


def _vs_ddp_worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = BNNet()
    if rank == 1:  # both wrappers must start from rank 0's values
        with torch.no_grad():
            for t in [*base.parameters(), *base.buffers()]:
                t.add_(1)
    ours = BucketDataParallel(copy.deepcopy(base))
    theirs = DistributedDataParallel(copy.deepcopy(base))
    runs = [(ours, torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)),
            (theirs, torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9))]  # fmt: skip
    for model, _ in runs:
        # An evaluation before training, under inference mode: the first buffer sync runs
        # there. Before, its flat buffer was an inference tensor that the next sync, outside
        # inference mode, could not write to.
        model.eval()
        with torch.inference_mode():
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank)))
        model.train()
    for step in range(8):
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        for model, opt in runs:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 2:  # an eval forward changes when the next sync happens
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
            if step == 5:  # so does a forward under no_sync()
                with model.no_sync():  # type: ignore[operator]
                    model(x).sum().backward()
                opt.zero_grad()
    return {
        name: {
            "buffers": {n: b.clone() for n, b in model.module.named_buffers()},
            "params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
        }
        for name, (model, _) in zip(("ours", "theirs"), runs, strict=True)
    }


@pytest.fixture(scope="module")
def vs_ddp() -> list[dict[str, Any]]:
    return run_ranks(_vs_ddp_worker, 2, timeout=TIMEOUT)


@pytest.mark.compat("buffers")
def test_default_broadcast_matches_torch_ddp_exactly(vs_ddp: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(vs_ddp):
        for kind in ("buffers", "params"):
            for name, theirs in r["theirs"][kind].items():
                ours = r["ours"][kind][name]
                assert torch.equal(ours, theirs), f"rank {rank} {kind} {name}"


def _inference_first(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = BNNet()
    rules = {"body.*.running_*": "mean", "body.*.num_batches_tracked": "sum"}
    wrapped = BucketDataParallel(model, buffer_sync=rules)
    with torch.inference_mode():
        wrapped.sync_buffers()  # the first sync of each group, in inference mode
    for step in range(2):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        wrapped(x).square().mean().backward()
    wrapped.sync_buffers()
    return {n: b.clone() for n, b in model.named_buffers()}


def test_policies_first_synced_under_inference_mode_keep_working() -> None:
    r0, r1 = run_ranks(_inference_first, 2, timeout=TIMEOUT)
    for name, value in r0.items():
        assert torch.equal(value, r1[name]), name
    # Two forwards on each of two ranks, counted once each: the "sum" baseline held.
    assert int(r0["body.1.num_batches_tracked"]) == 4


def test_ranks_buffers_differ_after_the_last_local_forward(vs_ddp: list[dict[str, Any]]) -> None:
    # The comparison above is not vacuous: the last forward updated each rank's running
    # statistics from its own batch, as torch DDP does.
    a, b = (r["ours"]["buffers"]["body.1.running_mean"] for r in vs_ddp)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("none_at_wrap", [False, True], ids=["registered_later", "none_at_wrap"])
def test_a_buffer_gained_after_wrapping_is_synced_as_by_torch_ddp(
    changed: list[dict[str, Any]], none_at_wrap: bool
) -> None:
    # Before, a buffer registered after wrapping was never synced: the ranks' copies drifted
    # 0.26 apart and the weights 7.9e-3 from torch DDP's.
    for result in changed:
        (theirs, their_weight), (ours, our_weight) = result[f"late {none_at_wrap}"].values()
        assert len(ours) == len(theirs) == 3
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        torch.testing.assert_close(our_weight, their_weight, atol=1e-6, rtol=0)
    first, second = (r[f"late {none_at_wrap}"]["ours"][0] for r in changed)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_buffers_that_join_leave_or_move_keep_their_policies(
    changed: list[dict[str, Any]],
) -> None:
    for result in changed:
        assert torch.equal(result["sum joins"], torch.tensor(20.0))  # 4 * (2 + 3)
        assert result["sum leaves"] == ["kept"]  # and the load after it raised nothing
        assert result["custom none"] == ("no error", ["other"])
        assert torch.equal(result["data assigned"], torch.full((4,), 1.0))
