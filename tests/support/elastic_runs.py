"""Running torchrun jobs for the elastic tests, and reading what they logged.

Nothing here imports Lightning.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch

from lightning_runs import run_script


def torchrun(
    script: Path,
    *args: str,
    restarts: int = 1,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> str:
    """Run ``script`` on 2 local workers under torchrun with ``restarts`` restarts; asserts
    that the job exits 0 and never by SIGABRT. Returns its output."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={restarts}",
        "--monitor-interval=0.1",
        str(script),
        *args,
    ]
    return run_script(cmd, timeout=timeout, env=env)


def done_twice(out: Path, rank: int) -> list[int]:
    """The steps rank ``rank`` completed in more than one attempt (from its step log)."""
    steps = Counter(
        int(line.split()[1])
        for line in (out / f"steps.rank{rank}").read_text().splitlines()
        if line.startswith("step ")
    )
    return sorted(s for s, n in steps.items() if n > 1)


def same_weights(a: Path, b: Path) -> bool:
    """Whether two saved state dicts are bit-equal."""
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
