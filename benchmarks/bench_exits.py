"""Clean exits under load: run each entry point many times beside a CPU hog, count signals.

    python3 dev.py bench-exits                          # 200 runs per entry point and system
    python3 dev.py bench-exits --runs 20 --entry fabric engine
    python3 dev.py bench-exits --python /path/to/venv/bin/python   # e.g. a wheel install
    python3 dev.py bench-exits --append --runs 20       # add 20 rounds to the saved counts
    python3 dev.py bench-exits --append --system bucketddp   # only bucketddp's runs

Each run is a fresh job of two CPU ranks that trains three steps and exits, with
bucketddp and, interleaved run by run, with the reference the same entry point offers
without bucketddp (torch DDP or Lightning's "ddp"):

- ``engine``: ``BucketDataParallel`` against torch DDP, two ``python`` processes, the
  script ending right after its last backward and optimizer step;
- ``torchrun``: the same script under ``torchrun --standalone --nproc-per-node 2``;
- ``trainer``: ``Trainer.fit`` with ``BucketDDP()`` against ``"ddp"``, Lightning's own
  launcher (rank 1 a child script of rank 0);
- ``fabric``: a Fabric loop with ``BucketFabricDDP()`` against ``"ddp"``, Fabric's own
  launcher, saving and loading a checkpoint before it exits (as examples/fabric_loop.py);
- ``notebook``: ``Trainer.fit`` with ``"bucket_ddp_notebook"`` against ``"ddp_notebook"``
  (ranks forked from the script's process).

A CPU-bound process per core (``--hogs``) runs for the whole benchmark. A run counts as
ended by a signal when any of its processes was (a negative exit code, torchrun's
"Signal N" report) or printed "terminate called"; any other non-zero exit is counted
apart. The output pipe is read until every process of the run has closed it, so a child
rank's exit counts too. The table gives, per entry point and system, the runs, the exits
by signal, the other failures and the median seconds a run took.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = ("engine", "torchrun", "trainer", "fabric", "notebook")
SYSTEMS = ("bucketddp", "reference")
STEPS = 3


# ----------------------------------------------------------------- what a run executes
def _engine(system: str) -> None:
    import torch
    import torch.distributed as dist

    wrap: Any = torch.nn.parallel.DistributedDataParallel
    if system == "bucketddp":
        from bucketddp import BucketDataParallel as wrap

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    model = wrap(net, bucket_cap_mb=0.02)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    # No destroy_process_group(): the script ends as most user scripts do.


def _trainer(system: str, notebook: bool) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel

    torch.set_num_threads(1)
    strategy: Any = "ddp_notebook" if notebook else "ddp"
    if system == "bucketddp":  # the reference never imports bucketddp (nor its exit handler)
        from bucketddp import BucketDDP

        strategy = "bucket_ddp_notebook" if notebook else BucketDDP()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())


def _fabric(system: str) -> None:
    import torch
    from lightning.fabric import Fabric

    torch.set_num_threads(1)
    strategy: Any = "ddp"
    if system == "bucketddp":
        from bucketddp import BucketFabricDDP

        strategy = BucketFabricDDP()
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model, opt = fabric.setup(*_model_and_optimizer())
    for _ in range(STEPS):
        fabric.backward(model(torch.randn(8, 32)).sum())
        opt.step()
        opt.zero_grad()
    with tempfile.TemporaryDirectory() as tmp:
        path = fabric.broadcast(os.path.join(tmp, "state.ckpt"))
        fabric.save(path, {"model": model, "optimizer": opt})
        fabric.load(path, {"model": model, "optimizer": opt})
        fabric.barrier()


def _model_and_optimizer() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    return net, torch.optim.SGD(net.parameters(), lr=0.01)


def child(entry: str, system: str) -> None:
    """One run's script body (``bench_exits.py --child ENTRY SYSTEM``)."""
    if entry in ("engine", "torchrun"):
        _engine(system)
    elif entry in ("trainer", "notebook"):
        _trainer(system, notebook=entry == "notebook")
    else:
        _fabric(system)


# ----------------------------------------------------------------- running and counting
def _command(python: str, entry: str, system: str) -> list[str]:
    me = [str(Path(__file__).resolve()), "--child", entry, system]
    if entry == "torchrun":
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *me]
    return [python, *me]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_once(python: str, entry: str, system: str, timeout: float) -> dict[str, Any]:
    """One run of ``entry`` with ``system``: exit codes, signals seen, seconds."""
    start = time.monotonic()
    cmd = _command(python, entry, system)
    ranks = 2 if entry == "engine" else 1  # the others start their second rank themselves
    port = _free_port()
    procs = []
    with tempfile.TemporaryDirectory() as cwd:
        for rank in range(ranks):
            env = dict(os.environ, OMP_NUM_THREADS="1")
            if system == "reference":  # an installed bucketddp must not load with Lightning
                env["BUCKETDDP_NO_STARTUP_HOOK"] = "1"
            if entry == "engine":
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=cwd,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        codes: list[int | str] = []
        text = ""
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
                codes.append(proc.returncode)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                codes.append("timeout")
            text += out.decode(errors="replace")
    by_signal = any(isinstance(c, int) and c < 0 for c in codes) or any(
        marker in text for marker in ("terminate called", "Signal 6", "SIGABRT", "core dumped")
    )
    failed = not by_signal and any(c != 0 for c in codes)
    return {
        "entry": entry,
        "system": system,
        "codes": codes,
        "signal": by_signal,
        "failed": failed,
        "seconds": time.monotonic() - start,
        "tail": text[-1500:] if (by_signal or failed) else "",
    }


def _hogs(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def report(runs: list[dict[str, Any]]) -> str:
    """The table: per entry point and system, runs, exits by signal, other failures, median s."""
    lines = [f"{'entry':<10}{'system':<11}{'runs':>6}{'signal':>8}{'failed':>8}{'median s':>10}"]
    for entry in ENTRIES:
        for system in SYSTEMS:
            rows = [r for r in runs if r["entry"] == entry and r["system"] == system]
            if not rows:
                continue
            median = statistics.median(r["seconds"] for r in rows)
            lines.append(
                f"{entry:<10}{system:<11}{len(rows):>6}{sum(r['signal'] for r in rows):>8}"
                f"{sum(r['failed'] for r in rows):>8}{median:>10.1f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the entry points interleaved beside the hogs, print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=200, help="runs per entry point and system")
    p.add_argument("--entry", nargs="+", choices=ENTRIES, default=list(ENTRIES))
    p.add_argument(
        "--system",
        nargs="+",
        choices=SYSTEMS,
        default=list(SYSTEMS),
        help="run only these systems (the reference's counts can stay at an earlier sitting's)",
    )
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="CPU-bound processes")
    p.add_argument("--python", default=sys.executable, help="the interpreter the runs use")
    p.add_argument("--timeout", type=float, default=300.0, help="hang guard per run, seconds")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "exits.json")
    p.add_argument(
        "--append",
        action="store_true",
        help="add to the runs already in --json, so that counts add up over several sittings",
    )
    p.add_argument("--child", nargs=2, metavar=("ENTRY", "SYSTEM"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    # A SIGTERM ends the benchmark as Ctrl-C does: the hogs are killed and the JSON written.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    hogs = _hogs(args.hogs)
    runs: list[dict[str, Any]] = []
    if args.append and args.json.exists():
        runs = json.loads(args.json.read_text())["runs"]
        print(f"adding to {len(runs)} earlier runs from {args.json}:\n{report(runs)}", flush=True)
    try:
        for i in range(args.runs):
            for entry in args.entry:
                for system in args.system:
                    result = run_once(args.python, entry, system, args.timeout)
                    runs.append(result)
                    if result["signal"] or result["failed"]:
                        print(f"run {i} {entry} {system}: {result['codes']}\n{result['tail']}")
            print(f"after {i + 1} rounds:\n{report(runs)}", flush=True)
            _save(args.json, args.hogs, runs)  # a sitting cut short keeps its finished rounds
    except KeyboardInterrupt:
        print(f"interrupted; the runs so far:\n{report(runs)}", flush=True)
    finally:
        for hog in hogs:
            hog.kill()
        _save(args.json, args.hogs, runs)
    return 0


def _save(path: Path, hogs: int, runs: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"hogs": hogs, "runs": runs}, indent=1))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
