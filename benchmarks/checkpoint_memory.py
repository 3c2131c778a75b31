"""Peak memory of a rank that receives a checkpoint from rank 0 (``bucketddp.load_checkpoint``).

    python benchmarks/checkpoint_memory.py                 # a 400 MB checkpoint, 2 ranks
    python benchmarks/checkpoint_memory.py --mb 300 --chunk-mb 16

Rank 0 writes a checkpoint shaped like a Lightning one (a state dict of many tensors plus
Adam's two moments for each) into a directory only it uses. Then every rank calls
``bucketddp.load_checkpoint`` with its own working directory, so rank 1 does not see the
file and receives it. Each rank resets its peak resident set (``/proc/self/clear_refs``)
just before the call and reads it (``VmHWM``) just after: the figure is the peak above the
resident set before the call. For contrast, the same contents then go through one
``broadcast_object_list`` (a pickled blob), the way a hand-rolled broadcast usually does it.
Linux only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools"))  # multirank
import bucketddp
from multirank import run_ranks


def _status(field: str) -> float:
    """A ``/proc/self/status`` field, in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def _measure(fn: Any) -> tuple[Any, float, float]:
    """``fn()``, its peak resident set above the one before it (MB), and its seconds."""
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before, start = _status("VmRSS"), time.perf_counter()
    result = fn()
    return result, _status("VmHWM") - before, time.perf_counter() - start


def _checkpoint(mb: float) -> dict[str, Any]:
    """About ``mb`` MB: weights, and Adam's moments for each (three tensors per layer)."""
    layer = 1024 * 1024  # 4 MB of float32 per tensor
    layers = max(1, round(mb * 2**20 / (3 * 4 * layer)))
    weights = {f"layer{i}.weight": torch.randn(layer) for i in range(layers)}
    moments = {
        i: {
            "step": torch.tensor(10.0),
            "exp_avg": torch.randn(layer),
            "exp_avg_sq": torch.rand(layer),
        }
        for i in range(layers)
    }
    return {
        "state_dict": weights,
        "optimizer_states": [{"state": moments, "param_groups": [{"lr": 1e-3}]}],
        "global_step": 10,
    }


def _rank(rank: int, world: int, base: str, mb: float, chunk_mb: float) -> dict[str, float]:
    os.chdir(os.path.join(base, f"rank{rank}"))
    if rank == 0:
        torch.save(_checkpoint(mb), "big.ckpt")
        file_mb = os.path.getsize("big.ckpt") / 2**20
    else:
        file_mb = 0.0
    got, peak, seconds = _measure(lambda: bucketddp.load_checkpoint("big.ckpt", chunk_mb=chunk_mb))
    size = sum(t.nbytes for t in got["state_dict"].values()) / 2**20
    size += (
        sum(t.nbytes for s in got["optimizer_states"][0]["state"].values() for t in s.values())
        / 2**20
    )
    contents = got if rank == 0 else None
    del got
    blob: list[Any] = [contents]
    _, blob_peak, blob_seconds = _measure(lambda: dist.broadcast_object_list(blob, src=0))
    return {
        "file_mb": file_mb,
        "tensor_mb": size,
        "peak_mb": peak,
        "seconds": seconds,
        "blob_peak_mb": blob_peak,
        "blob_seconds": blob_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=400.0, help="checkpoint size (MB)")
    parser.add_argument("--chunk-mb", type=float, default=bucketddp.checkpoint.DEFAULT_CHUNK_MB)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as base:
        for rank in (0, 1):
            os.mkdir(os.path.join(base, f"rank{rank}"))
        r0, r1 = run_ranks(_rank, 2, base, args.mb, args.chunk_mb, timeout=600)
    print(f"checkpoint: {r0['file_mb']:.0f} MB on disk, {r0['tensor_mb']:.0f} MB of tensors")
    print(f"chunk_mb={args.chunk_mb:g}")
    for rank, r in enumerate((r0, r1)):
        role = "reads and sends" if rank == 0 else "receives"
        print(
            f"rank {rank} ({role}): load_checkpoint peak +{r['peak_mb']:.0f} MB "
            f"in {r['seconds']:.1f} s; one pickled blob: +{r['blob_peak_mb']:.0f} MB "
            f"in {r['blob_seconds']:.1f} s"
        )


if __name__ == "__main__":
    main()
