"""Running Lightning scenarios as scripts, and comparing what they saved.

The scenarios live in ``lightning_scenarios.py``; test_strategy.py and test_cuda.py run
them through ``scenario`` or ``run_script`` and compare the weights with ``assert_same``.
``torchrun`` runs a script under torchrun the same way (the elastic tests; the job's
commands are in tools/elastic_runs.py). Nothing here imports Lightning.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_runs import standalone

SUPPORT = Path(__file__).resolve().parent
SCENARIOS = SUPPORT / "lightning_scenarios.py"
ROOT = SUPPORT.parents[1]
"""The repository root: the scripts' working directory."""


def run_script(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` in a session of its own and wait for every process it started.

    The output pipe reaches EOF only once the ranks a launcher started have exited too, so
    their exit is checked as well: no run may end in "terminate called" (SIGABRT).
    """
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[1:3]} did not finish within {timeout:.0f}s:\n{_tail(out)}")
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"{cmd[1:3]} exited with {proc.returncode}:\n{_tail(out)}"
    assert "terminate called" not in text, _tail(out)
    return text


def _tail(out: bytes, n: int = 6000) -> str:
    return out.decode(errors="replace")[-n:]


def scenario(
    name: str, out: Path, *extra: str, timeout: float = 240, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run one scenario; returns what each rank saved, in rank order."""
    run_script([sys.executable, str(SCENARIOS), name, str(out), *extra], timeout=timeout, env=env)
    files = sorted(out.glob(f"{name}.rank*.pt"))
    assert files, f"scenario {name} saved no results in {out}"
    return [torch.load(f, weights_only=False) for f in files]


def assert_same(
    a: dict[str, torch.Tensor],
    b: dict[str, torch.Tensor],
    tol: float = 0.0,
    skip: tuple[str, ...] = (),
) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if any(s in name for s in skip):
            continue
        x, y = a[name].double(), b[name].double()
        worst = float((x - y).abs().max()) if x.numel() else 0.0
        assert worst <= tol, f"{name} differs by {worst:.3g}"


def moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[n], b[n]) for n in a if a[n].is_floating_point())


def run_nodes(
    script: Path, name: str, out: Path, nodes: int, *extra: str, timeout: float = 240
) -> list[dict[str, Any]]:
    """Run scenario ``name`` of ``script`` as ``nodes`` single-process "nodes", each started
    here in a working directory of its own (``out/node<R>``), with the variables Lightning's
    environment reads (``NODE_RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...), as a cluster's
    launcher would. Returns what each rank saved to ``out/<name>.rank<R>.pt``, in rank order.
    """
    from multirank import free_port

    paths = [str(ROOT / "src"), str(SUPPORT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in paths if p),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nodes),
        "LOCAL_RANK": "0",
    }
    procs = []
    for node in range(nodes):
        (out / f"node{node}").mkdir(parents=True, exist_ok=True)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), name, str(out), *extra],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**env, "NODE_RANK": str(node)},
                cwd=out / f"node{node}",
            )
        )
    outputs = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            outputs.append(text.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} did not finish within {timeout:.0f}s")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for node, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"node {node} exited with {p.returncode}:\n{text[-6000:]}"
        assert "terminate called" not in text, text[-6000:]
    return [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(nodes)]


def torchrun(
    script: Path,
    *args: str,
    restarts: int = 1,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> str:
    """Run ``script`` on 2 local workers under torchrun with ``restarts`` restarts; asserts
    that the job exits 0 and never by SIGABRT. Returns its output."""
    cmd = [*standalone(restarts), str(script), *args]
    return run_script(cmd, timeout=timeout, env=env)
