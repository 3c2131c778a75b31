"""bucketddp.load_checkpoint: rank 0 reads, every rank resumes, with no shared filesystem.

Each rank works in a directory of its own, as on separate nodes, and the checkpoint's
relative path exists only in rank 0's. An audit hook on the other ranks records every file
they open, so "never opens the file" is checked, not trusted. The ground truth is the run
that never stopped, and torch DDP.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketddp
from bucketddp import BucketDataParallel
from bucketddp.checkpoint import broadcast_checkpoint, plan_pieces, strip_prefix
from models import batch, build
from multirank import raised, run_ranks

CKPT = "checkpoints/step3.pt"
"""The checkpoint's path, relative to each rank's working directory."""


def _record_opens(name: str) -> list[str]:
    """Every path this process opens from now on whose name contains ``name``."""
    opened: list[str] = []

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and name in str(args[0]):
            opened.append(str(args[0]))

    sys.addaudithook(hook)
    return opened


def _train(wrapped: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x, y = batch("conv", step, rank)
        F.mse_loss(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(opt.state_dict()["state"]),
    }


def _new(wrap: Any) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    model = build("conv")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, wrap(model), opt


def _resume_loop(rank: int, world: int, base: str) -> dict[str, Any]:
    os.chdir(os.path.join(base, f"rank{rank}"))
    opened = _record_opens(".pt") if rank else []
    if rank:
        open("probe.pt", "w").close()  # the hook is live: this one must be recorded
    # Six steps straight, under BucketDataParallel and under torch DDP.
    model, wrapped, opt = _new(BucketDataParallel)
    _train(wrapped, opt, rank, range(6))
    straight = _state(model, opt)
    model, ddp, ddp_opt = _new(DDP)
    _train(ddp, ddp_opt, rank, range(6))
    straight_ddp = _state(model, ddp_opt)

    # Three steps, and a checkpoint written by rank 0 into its own directory.
    model, wrapped, opt = _new(BucketDataParallel)
    _train(wrapped, opt, rank, range(3))
    if rank == 0:
        os.makedirs("checkpoints")
        saved = {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "step": 3,
            "bucketddp": {"bucket_order": wrapped.bucket_order},
            "notes": {"tag": "mine", "shared": [model.head.weight, model.head.weight]},
        }
        torch.save(saved, CKPT)
    # The same three steps under torch DDP, saved from the wrapper: keys "module.*".
    model, ddp, ddp_opt = _new(DDP)
    _train(ddp, ddp_opt, rank, range(3))
    if rank == 0:
        torch.save({"model": ddp.state_dict(), "optimizer": ddp_opt.state_dict()}, "ddp.pt")
    dist.barrier()

    # Resume from a fresh model: one call loads everything, on every rank.
    torch.manual_seed(123)  # a different start, so the load has to do the work
    model = build("conv")
    ckpt = bucketddp.load_checkpoint(CKPT)
    model.load_state_dict(ckpt["model"])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt.load_state_dict(ckpt["optimizer"])
    wrapped = BucketDataParallel(model)
    adopted = wrapped.load_bucket_order(ckpt["bucketddp"]["bucket_order"])
    _train(wrapped, opt, rank, range(ckpt["step"], 6))
    resumed = _state(model, opt)

    # A torch DDP checkpoint ("module." keys) resumes under BucketDataParallel, and a
    # BucketDataParallel checkpoint under torch DDP; "ddp.pt" is rank 0's only too.
    ddp_ckpt = bucketddp.load_checkpoint("ddp.pt")
    model = build("conv", seed=5)
    model.load_state_dict(strip_prefix(ddp_ckpt["model"]))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt.load_state_dict(ddp_ckpt["optimizer"])
    _train(BucketDataParallel(model), opt, rank, range(3, 6))
    from_ddp = _state(model, opt)
    # (Loaded afresh: the optimizer above took the loaded state tensors in and stepped them.)
    again = bucketddp.load_checkpoint(CKPT, source="rank0")
    model = build("conv", seed=5)
    model.load_state_dict(again["model"])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt.load_state_dict(again["optimizer"])
    _train(DDP(model), opt, rank, range(3, 6))
    under_ddp = _state(model, opt)
    return {
        "straight": straight,
        "straight_ddp": straight_ddp,
        "resumed": resumed,
        "from_ddp": from_ddp,
        "under_ddp": under_ddp,
        "adopted": adopted,
        "notes": ckpt["notes"],
        "shared": ckpt["notes"]["shared"][0] is ckpt["notes"]["shared"][1],
        "opened": opened,
        "cwd": os.getcwd(),
    }


def _assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for i in a["optimizer"]:
        for k in a["optimizer"][i]:
            assert torch.equal(a["optimizer"][i][k], b["optimizer"][i][k]), (i, k)


@pytest.mark.compat("resume")
def test_hand_written_loop_resumes_from_rank0_only_checkpoint(tmp_path: Path) -> None:
    for rank in (0, 1):
        (tmp_path / f"rank{rank}").mkdir()
    r0, r1 = run_ranks(_resume_loop, 2, str(tmp_path))
    assert not (tmp_path / "rank1" / "checkpoints").exists()
    assert r1["opened"] == ["probe.pt"]  # rank 1 never opened either checkpoint
    for r in (r0, r1):
        assert r["adopted"]
        _assert_equal(r["resumed"], r["straight"])  # bit for bit, weights and Adam state
        _assert_equal(r["straight"], r["straight_ddp"])
        _assert_equal(r["from_ddp"], r["straight"])
        _assert_equal(r["under_ddp"], r["straight_ddp"])
        assert r["notes"]["tag"] == "mine"
        assert r["shared"]  # one tensor twice in the file is one tensor on every rank
    for k, v in r0["resumed"]["model"].items():  # BatchNorm statistics are each rank's own
        assert "running" in k or torch.equal(v, r1["resumed"]["model"][k]), k


# ------------------------------------------------------------------------- transport
def _odd_objects(rank: int, world: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(7, 5, generator=g)
    sent = {
        "transposed": base.t(),
        "views": (base, base[2:4]),
        "param": nn.Parameter(torch.randn(3, generator=g)),
        "frozen": nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
        "bf16": torch.randn(9, generator=g).bfloat16(),
        "bool": torch.rand(11, generator=g) > 0.5,
        "complex": torch.randn(4, dtype=torch.complex64, generator=g),
        "int": torch.arange(13, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "sparse": torch.eye(3).to_sparse(),
        "plain": [1, "two", None, {"three": 3.0}],
    }
    got = broadcast_checkpoint(sent if rank == 0 else None, chunk_mb=40 / 2**20)
    return {"sent": sent, "got": got, "same_object": got is sent}


def test_broadcast_keeps_every_kind_of_value() -> None:
    r0, r1 = run_ranks(_odd_objects, 2)
    assert r0["same_object"]
    sent, got = r0["sent"], r1["got"]
    assert got.keys() == sent.keys()
    for name, want in sent.items():
        have = got[name]
        if isinstance(want, torch.Tensor):
            assert type(have) is type(want), name
            assert have.dtype == want.dtype and have.requires_grad == want.requires_grad, name
            assert torch.equal(have.to_dense(), want.to_dense()), name
    assert got["plain"] == sent["plain"]
    assert all(torch.equal(a, b) for a, b in zip(got["views"], sent["views"], strict=True))


def test_plan_pieces() -> None:
    assert plan_pieces([4, 0, 3, 10], 5) == [
        [(0, 0, 4), (2, 0, 1)],
        [(2, 1, 3), (3, 0, 3)],
        [(3, 3, 8)],
        [(3, 8, 10)],
    ]
    assert plan_pieces([], 5) == []
    with pytest.raises(ValueError):
        plan_pieces([1], 0)


def test_strip_prefix() -> None:
    assert strip_prefix({"module.a": 1, "module.b": 2}) == {"a": 1, "b": 2}
    assert strip_prefix({"module.a": 1, "b": 2}) == {"module.a": 1, "b": 2}


# ---------------------------------------------------------------------------- errors
def _errors(rank: int, world: int, base: str) -> dict[str, str]:
    os.chdir(os.path.join(base, f"rank{rank}"))
    load = bucketddp.load_checkpoint
    return {
        "nowhere": raised(lambda: load("missing.pt"), FileNotFoundError),
        "not_on_rank0": raised(lambda: load("only_rank1.pt"), FileNotFoundError),
        "local": raised(lambda: load("only_rank0.pt", source="local"), FileNotFoundError),
        "corrupt": raised(lambda: load("corrupt.pt"), Exception),
    }


def test_errors_reach_every_rank(tmp_path: Path) -> None:
    for rank in (0, 1):
        (tmp_path / f"rank{rank}").mkdir()
    torch.save({}, tmp_path / "rank1" / "only_rank1.pt")
    torch.save({}, tmp_path / "rank0" / "only_rank0.pt")
    (tmp_path / "rank0" / "corrupt.pt").write_bytes(b"not a checkpoint")
    r0, r1 = run_ranks(_errors, 2, str(tmp_path))
    for r in (r0, r1):
        assert "'missing.pt' not found on rank 0" in r["nowhere"]
        assert str(tmp_path / "rank0" / "missing.pt") in r["nowhere"]
        assert "'only_rank1.pt' not found on rank 0" in r["not_on_rank0"]
        assert "not found on ranks [1]" in r["local"] and "source='auto'" in r["local"]
    assert "rank 0 could not read checkpoint 'corrupt.pt'" in r1["corrupt"]
    assert "rank 0 could not" not in r0["corrupt"]  # rank 0 raises torch.load's own error


# ---------------------------------------------------------------------------- memory
def _peak_rss(rank: int, world: int, mb: int, chunk_mb: float) -> dict[str, float]:
    n = mb * 2**20 // 4 // 8
    state = {f"w{i}": torch.full((n,), float(i)) for i in range(8)} if rank == 0 else None
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident set
    before = _status("VmRSS")
    got = broadcast_checkpoint(state, chunk_mb=chunk_mb)
    peak = _status("VmHWM")
    assert all(float(got[f"w{i}"][-1]) == i for i in range(8))
    return {"extra_mb": (peak - before) / 1024}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])  # kB
    raise AssertionError(field)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_receiving_rank_holds_the_checkpoint_once() -> None:
    mb, chunk = 48, 4.0
    _, r1 = run_ranks(_peak_rss, 2, mb, chunk)
    # The received tensors (48 MB), one staging piece (4 MB) and some slack: about 60 MB
    # here. A pickled blob of the whole state needs the state two or three times over.
    assert r1["extra_mb"] < 1.5 * mb, r1
