"""The "sum" policy across many syncs, checkpoints and resumes, on real gloo process groups.

Counters that each rank adds to in training forwards must read the global total after every
sync: through repeated syncs, evaluation and no_sync() forwards, a load into the running
wrapper, a fresh wrapper around a loaded model, a partial load, and new processes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from bucketddp import BucketDataParallel
from multirank import run_ranks

TIMEOUT = 60.0


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
