"""SyncBatchNorm against single-process BatchNorm on the concatenated global batch.

Each distributed worker runs many cases in one process group (starting ranks is the slow
part); the comparisons happen here, in the test process, against a reference computed from
the same seeded data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.profiler import ProfilerActivity, profile

from bucketddp import BucketDataParallel
from bucketddp.syncbn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from multirank import run_ranks

TOL = {"rtol": 1e-5, "atol": 1e-5}
BN_CLASSES = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


@dataclass(frozen=True)
class Case:
    """One SyncBatchNorm configuration and the per-rank batch sizes it is run with."""

    name: str
    bn: int  # 1, 2 or 3: which BatchNorm class
    spatial: tuple[int, ...]  # the input's dimensions after (N, C)
    sizes: tuple[int, ...]  # batch size of each rank, in rank order
    channels: int = 3
    momentum: float | None = 0.1
    affine: bool = True
    track_running_stats: bool = True
    dtype: torch.dtype = torch.float32
    steps: int = 3
    kwargs: dict[str, Any] = field(default_factory=dict)

    def make_bn(self) -> nn.Module:
        torch.manual_seed(0)
        bn = BN_CLASSES[self.bn](
            self.channels,
            momentum=self.momentum,
            affine=self.affine,
            track_running_stats=self.track_running_stats,
        )
        if self.affine:
            with torch.no_grad():
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.5, 0.5)
        return bn

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global input of a step, and the fixed weights of its loss."""
        g = torch.Generator().manual_seed(1000 * step + len(self.name))
        shape = (sum(self.sizes), self.channels, *self.spatial)
        scale = torch.rand(self.channels, generator=g) * 3 + 0.5
        shift = torch.randn(self.channels, generator=g) * 2
        view = (1, -1) + (1,) * len(self.spatial)
        x = torch.randn(shape, generator=g) * scale.view(view) + shift.view(view)
        return x.to(self.dtype), torch.randn(shape, generator=g)

    def bounds(self, rank: int) -> tuple[int, int]:
        lo = sum(self.sizes[:rank])
        return lo, lo + self.sizes[rank]


CASES = [
    Case("1d_NC_uneven", 1, (), (5, 3), channels=4),
    Case("1d_NCL", 1, (4,), (3, 3)),
    Case("2d_uneven", 2, (3, 3), (4, 2)),
    Case("3d", 3, (2, 3, 2), (2, 3)),
    Case("empty_rank0", 2, (3, 2), (0, 4)),
    Case("empty_rank1", 1, (5,), (3, 0)),
    Case("momentum_none", 2, (2, 2), (3, 2), momentum=None),
    Case("no_affine", 1, (), (4, 4), affine=False),
    Case("no_running_stats", 2, (2, 3), (2, 3), track_running_stats=False),
    Case("all_empty", 1, (), (0, 0), steps=2),
    Case("bfloat16_input", 2, (3, 3), (3, 3), dtype=torch.bfloat16, steps=2),
]


def _collectives(prof: profile) -> int:
    return sum(1 for e in prof.events() if e.name.startswith("c10d::"))


def _run_case(layer: nn.Module, case: Case, lo: int, hi: int) -> dict[str, Any]:
    """Train ``layer`` for the case's steps on rows lo:hi of each global batch, then eval."""
    steps = []
    for step in range(case.steps):
        x_full, w_full = case.batch(step)
        x = x_full[lo:hi].clone().requires_grad_(True)
        with profile(activities=[ProfilerActivity.CPU]) as fwd:
            out = layer(x)
        loss = (out.float() * w_full[lo:hi]).sum()
        with profile(activities=[ProfilerActivity.CPU]) as bwd:
            loss.backward()
        steps.append(
            {
                "out": out.detach().float(),
                "grad_x": x.grad.float(),
                "grad_w": None if layer.weight is None else layer.weight.grad.clone(),
                "grad_b": None if layer.bias is None else layer.bias.grad.clone(),
                "buffers": {k: v.clone() for k, v in layer.named_buffers()},
                "fwd_collectives": _collectives(fwd),
                "bwd_collectives": _collectives(bwd),
            }
        )
        layer.zero_grad(set_to_none=True)
    layer.eval()
    x_eval, _ = case.batch(99)
    with profile(activities=[ProfilerActivity.CPU]) as ev, torch.no_grad():
        out_eval = layer(x_eval[lo:hi])
    layer.train()
    return {"steps": steps, "eval_out": out_eval.float(), "eval_collectives": _collectives(ev)}


def _reference(case: Case, groups: list[list[int]] | None = None) -> list[dict[str, Any]]:
    """What each rank should see: BatchNorm over the concatenated batch of its group."""
    groups = groups or [list(range(len(case.sizes)))]
    per_rank: list[dict[str, Any]] = [{} for _ in case.sizes]
    for ranks in groups:
        bn = case.make_bn()
        lo, hi = case.bounds(ranks[0])[0], case.bounds(ranks[-1])[1]
        steps = []
        for step in range(case.steps):
            x_full, w_full = case.batch(step)
            x = x_full[lo:hi].float().requires_grad_(True)
            out = bn(x)
            (out * w_full[lo:hi]).sum().backward()
            steps.append(
                {
                    "out": out.detach(),
                    "grad_x": x.grad,
                    "grad_w": None if bn.weight is None else bn.weight.grad.clone(),
                    "grad_b": None if bn.bias is None else bn.bias.grad.clone(),
                    "buffers": {k: v.clone() for k, v in bn.named_buffers()},
                }
            )
            bn.zero_grad(set_to_none=True)
        bn.eval()
        x_eval, _ = case.batch(99)
        with torch.no_grad():
            if case.track_running_stats:
                eval_out = {r: bn(x_eval[slice(*case.bounds(r))].float()) for r in ranks}
            else:  # no running statistics: eval normalizes each rank's own batch
                eval_out = {
                    r: bn(x_eval[slice(*case.bounds(r))].float()) if case.sizes[r] > 1 else None
                    for r in ranks
                }
        for r in ranks:
            per_rank[r] = {"steps": steps, "lo": lo, "eval_out": eval_out[r]}
    return per_rank


def _compare(case: Case, results: list[dict[str, Any]], groups: list[list[int]] | None = None):
    tol = TOL if case.dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    ref = _reference(case, groups)
    for ranks in groups or [list(range(len(case.sizes)))]:
        for step in range(case.steps):
            want = ref[ranks[0]]["steps"][step]
            got = [results[r]["steps"][step] for r in ranks]
            where = f"{case.name}, ranks {ranks}, step {step}"
            out = torch.cat([g["out"] for g in got])
            torch.testing.assert_close(out, want["out"], **tol, msg=f"output, {where}")
            grad_x = torch.cat([g["grad_x"] for g in got])
            torch.testing.assert_close(grad_x, want["grad_x"], **tol, msg=f"input grad, {where}")
            for key in ("grad_w", "grad_b"):
                if want[key] is None:
                    assert all(g[key] is None for g in got)
                    continue
                # Parameter gradients are per-rank sums; the data-parallel wrapper adds them.
                total = torch.stack([g[key] for g in got]).sum(0)
                torch.testing.assert_close(total, want[key], **tol, msg=f"{key}, {where}")
            for r, g in zip(ranks, got, strict=True):
                assert g["buffers"].keys() == want["buffers"].keys()
                for name, value in want["buffers"].items():
                    torch.testing.assert_close(
                        g["buffers"][name], value, **TOL, msg=f"{name}, rank {r}, {where}"
                    )
        for r in ranks:
            if ref[r]["eval_out"] is not None:
                torch.testing.assert_close(
                    results[r]["eval_out"], ref[r]["eval_out"], **tol, msg=f"eval, rank {r}"
                )
            assert results[r]["eval_collectives"] == 0, "eval must not communicate"


# ---------------------------------------------------------------- 2 ranks, default group


def _cases_worker(rank: int, world: int, cases: list[Case]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in cases:
        layer = convert_sync_batchnorm(case.make_bn())
        assert isinstance(layer, SyncBatchNorm)
        out[case.name] = _run_case(layer, case, *case.bounds(rank))

    # Two BatchNorm layers in a row: one collective each in forward and in backward.
    torch.manual_seed(0)
    net = convert_sync_batchnorm(
        nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 3), nn.BatchNorm1d(3))
    )
    x = torch.randn(4, 3, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as fwd:
        y = net(x)
    with profile(activities=[ProfilerActivity.CPU]) as bwd:
        y.sum().backward()
    out["two_layers"] = (_collectives(fwd), _collectives(bwd))

    # An input that needs no gradient (a first layer): backward has nothing to reduce.
    layer = convert_sync_batchnorm(nn.BatchNorm1d(3))
    y = layer(torch.randn(4, 3))
    with profile(activities=[ProfilerActivity.CPU]) as bwd:
        y.sum().backward()
    out["no_input_grad"] = (_collectives(bwd), layer.weight.grad is not None)

    # One value per channel across the group is as much an error as in BatchNorm.
    layer = convert_sync_batchnorm(nn.BatchNorm1d(3))
    try:
        layer(torch.randn(1 - rank, 3))
        out["one_value"] = None
    except ValueError as e:
        out["one_value"] = str(e)
    return out


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict[str, Any]]:
    return run_ranks(_cases_worker, 2, CASES, timeout=120)


@pytest.mark.compat("syncbn")
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_batchnorm_on_global_batch(case: Case, two_rank_results: list[dict[str, Any]]):
    results = [r[case.name] for r in two_rank_results]
    _compare(case, results)
    for rank, res in enumerate(results):
        for step, s in enumerate(res["steps"]):
            everyone_empty = sum(case.sizes) == 0
            assert s["fwd_collectives"] == 1, f"rank {rank} step {step} forward"
            assert s["bwd_collectives"] == (0 if everyone_empty else 1), f"rank {rank} backward"


def test_one_collective_per_layer_each_way(two_rank_results: list[dict[str, Any]]):
    for res in two_rank_results:
        assert res["two_layers"] == (2, 2)
        # Only parameter gradients are wanted: they are local sums, no collective needed.
        assert res["no_input_grad"] == (0, True)


def test_one_value_per_channel_raises_on_every_rank(two_rank_results: list[dict[str, Any]]):
    for res in two_rank_results:
        assert res["one_value"] is not None
        assert "more than 1 value per channel" in res["one_value"]


# ---------------------------------------------------------------- 4 ranks in 2 groups

GROUP_CASE = Case("groups", 2, (2, 2), (3, 1, 2, 4), channels=3)
GROUPS = [[0, 1], [2, 3]]


def _groups_worker(rank: int, world: int, case: Case) -> dict[str, Any]:
    # new_group is collective: every rank creates every group, in the same order.
    pairs = [dist.new_group(ranks) for ranks in GROUPS]
    singles = [dist.new_group([r]) for r in range(world)]
    mine = pairs[rank // 2]

    layer = convert_sync_batchnorm(case.make_bn(), process_group=mine)
    out = {"pairs": _run_case(layer, case, *case.bounds(rank))}

    # A group of one rank is plain BatchNorm over the local batch, without communication.
    alone = convert_sync_batchnorm(case.make_bn(), process_group=singles[rank])
    out["single"] = _run_case(alone, case, *case.bounds(rank))

    # A rank outside the layer's group is told so instead of hanging.
    if rank >= 2:
        stranger = convert_sync_batchnorm(case.make_bn(), process_group=pairs[0])
        try:
            stranger(torch.randn(4, 3, 2, 2))
            out["stranger"] = None
        except RuntimeError as e:
            out["stranger"] = str(e)
    return out


def test_process_group_subsets_sync_within_their_group():
    results = run_ranks(_groups_worker, 4, GROUP_CASE, timeout=120)
    _compare(GROUP_CASE, [r["pairs"] for r in results], groups=GROUPS)
    _compare(GROUP_CASE, [r["single"] for r in results], groups=[[r] for r in range(4)])
    for r, res in enumerate(results):
        assert {s["fwd_collectives"] for s in res["pairs"]["steps"]} == {1}
        assert {s["fwd_collectives"] + s["bwd_collectives"] for s in res["single"]["steps"]} == {0}
        if r >= 2:
            assert "not a member of the process_group" in res["stranger"]


# ---------------------------------------------------------------- with BucketDataParallel


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8, momentum=None),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
        nn.BatchNorm1d(4),
    )


def _train_data(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(batch, 3, 6, 6, generator=g) * 2 + 1, torch.randn(batch, 4, generator=g))
        for _ in range(steps)
    ]


def _ddp_worker(
    rank: int, world: int, steps: int, per_rank: int, compiled: bool, hook: str | None = None
) -> dict[str, Any]:
    if hook is None:
        model = BucketDataParallel(convert_sync_batchnorm(_conv_net()))
    else:
        # A bucket per parameter: each bucket's hook is called from the previous one's future,
        # on another thread, while the backward thread all-reduces in SyncBatchNorm.
        model = BucketDataParallel(
            convert_sync_batchnorm(_conv_net()), bucket_cap_mb=1e-7, first_bucket_mb=1e-7
        )
        if hook == "allreduce":
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        else:  # PowerSGD also launches collectives from its futures' callbacks
            state = powerSGD.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
            model.register_comm_hook(state, powerSGD.powerSGD_hook)
    if compiled:
        # Dynamo traces the layers' all-reduces into the graph.
        model = torch.compile(model, backend="aot_eager")  # type: ignore[assignment]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _train_data(steps, per_rank * world):
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
    moved = [m.process_group is not None for m in model.modules() if isinstance(m, SyncBatchNorm)]
    plain = revert_sync_batchnorm(model.module)
    return {
        "moved": moved,
        "state": {k: v.clone() for k, v in plain.state_dict().items()},
        "classes": [type(m).__name__ for m in plain.modules()],
        "policies": dict(model.buffers_sync.policies),
    }


@pytest.mark.parametrize(
    ("compiled", "hook"),
    [
        pytest.param(False, None, marks=pytest.mark.compat("syncbn")),
        (True, None),
        (False, "allreduce"),
    ],
    ids=["eager", "compiled", "comm_hook"],
)
def test_bucket_data_parallel_matches_single_process_training(compiled: bool, hook: str | None):
    # "comm_hook": before, the hooks' all-reduces and SyncBatchNorm's ran on one group in an
    # order that differed by rank: gloo aborted with a collective mismatch.
    steps, per_rank = 3, 4
    results = run_ranks(_ddp_worker, 2, steps, per_rank, compiled, hook, timeout=120)
    # With a hook, the layers normalize over a private group; without, over the default one.
    assert all(r["moved"] == [hook is not None] * 3 for r in results)

    model = _conv_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _train_data(steps, per_rank * 2):
        loss = nn.functional.mse_loss(model(x), y)  # the mean over the global batch
        opt.zero_grad()
        loss.backward()
        opt.step()

    for rank, res in enumerate(results):
        assert res["state"].keys() == model.state_dict().keys()
        for name, want in model.state_dict().items():
            torch.testing.assert_close(res["state"][name], want, **TOL, msg=f"{name} on {rank}")
        assert "SyncBatchNorm" not in res["classes"]
        # SyncBatchNorm's statistics are global already: its buffers cost no buffer sync.
        bn_buffers = [n for n in res["policies"] if n.split(".")[0] in {"1", "4", "9"}]
        assert len(bn_buffers) == 9
        assert all(res["policies"][n] == "none" for n in bn_buffers)


def _shared_bn_net() -> nn.Module:
    """One BatchNorm applied twice, so registered under two names."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    return nn.Sequential(
        bn, nn.Conv2d(3, 3, 3, padding=1), bn, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
    )


def _shared_bn_worker(rank: int, world: int, steps: int, per_rank: int) -> dict[str, Any]:
    net = convert_sync_batchnorm(_shared_bn_net())
    assert isinstance(net[0], SyncBatchNorm) and net[2] is net[0]
    model = BucketDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _train_data(steps, per_rank * world):
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows, :3])
        opt.zero_grad()
        loss.backward()
        opt.step()
    plain = revert_sync_batchnorm(model.module)
    assert type(plain[0]) is nn.BatchNorm2d and plain[2] is plain[0]
    return {k: v.clone() for k, v in plain.state_dict().items()}


def test_a_layer_under_two_names_is_converted_once_and_stays_shared():
    # Before, only the first name was converted: the second normalized with each rank's
    # own statistics, and the shared running statistics drifted apart between ranks.
    steps, per_rank = 3, 4
    model = _shared_bn_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _train_data(steps, per_rank * 2):
        loss = nn.functional.mse_loss(model(x), y[:, :3])
        opt.zero_grad()
        loss.backward()
        opt.step()
    for rank, state in enumerate(run_ranks(_shared_bn_worker, 2, steps, per_rank, timeout=60)):
        for name, want in model.state_dict().items():
            torch.testing.assert_close(state[name], want, **TOL, msg=f"{name} on {rank}")


def test_powersgd_with_syncbatchnorm_trains_alike_on_every_rank():
    # PowerSGD is lossy, so there is no exact ground truth; the ranks must finish (no
    # collective mismatch) with the same weights and statistics.
    results = run_ranks(_ddp_worker, 2, 4, 4, False, "powersgd", timeout=120)
    assert results[0]["moved"] == [True] * 3
    for name, value in results[0]["state"].items():
        assert torch.equal(value, results[1]["state"][name]), name


class _BranchNet(nn.Module):
    """A layer after the BatchNorm that each rank runs or skips, step by step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 4)
        self.bn = nn.BatchNorm1d(4)
        self.branch = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.bn(self.inp(x))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


# By step, whether ranks 0 and 1 run the branch.
_BRANCH_STEPS = [(True, True), (True, False), (True, False), (False, True), (False, False)]


def _branch_worker(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for engine in ("torch", "bucketddp"):
        # The ground truth: torch DDP, with the layer on a group of its own so that torch's
        # bucket all-reduces cannot cross it either.
        group = dist.new_group() if engine == "torch" else None
        net = convert_sync_batchnorm(_BranchNet(), process_group=group)
        if engine == "torch":
            model: nn.Module = nn.parallel.DistributedDataParallel(
                net, find_unused_parameters=True, bucket_cap_mb=1e-4
            )
        else:
            # A bucket per parameter: the branch's bucket all-reduce comes before the
            # layer's backward all-reduce on a rank that ran the branch, after it elsewhere.
            model = BucketDataParallel(
                net, find_unused_parameters=True, bucket_cap_mb=1e-4, first_bucket_mb=1e-4
            )
            assert net.bn.process_group is not None  # moved to a private group
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        for use in _BRANCH_STEPS:
            loss = model(torch.randn(4, 6, generator=g), use[rank]).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        out[engine] = {k: v.clone() for k, v in revert_sync_batchnorm(net).state_dict().items()}
    return out


def test_a_layer_only_some_ranks_run_beside_syncbatchnorm_matches_torch_ddp():
    # Before, the layer's all-reduce shared the wrapper's group: ranks issued it and the
    # branch's bucket all-reduce in different orders, and gloo aborted ("Received data size
    # doesn't match expected size"). torch DDP got through.
    for rank, res in enumerate(run_ranks(_branch_worker, 2, timeout=60)):
        for name, want in res["torch"].items():
            got = res["bucketddp"][name]
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{name} on {rank}")
