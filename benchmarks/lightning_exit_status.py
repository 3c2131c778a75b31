"""How often does a tiny 2-process Lightning fit end abnormally? Run it N times and count.

    python benchmarks/lightning_exit_status.py --runs 30                  # BucketDDP
    python benchmarks/lightning_exit_status.py --runs 30 --strategy ddp   # Lightning's DDP

Lightning with gloo sometimes ends a run with SIGABRT ("terminate called without an active
exception"): a gloo process group still alive when the interpreter shuts down. BucketDDP
destroys the group it created at exit, so it should end cleanly every time.

Each run is a fresh ``python`` process that fits BoringModel for two steps on two CPU
processes through Lightning's default (subprocess) launcher. A run counts as abnormal when
rank 0 exits non-zero or any rank prints "terminate called"; the output pipe is read until
every process of the run has closed it, so rank 1's exit is observed too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time


def child(strategy: str) -> None:
    """One tiny fit; this is what each run executes."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel

    import bucketddp  # noqa: F401  (registers "bucket_ddp")

    torch.set_num_threads(1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())


def run_once(strategy: str, timeout: float) -> dict[str, object]:
    """Start one run in its own session and wait for all of its processes."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child", "--strategy", strategy],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return {"rc": "timeout", "aborts": 0, "seconds": timeout, "abnormal": True}
    text = out.decode(errors="replace")
    aborts = text.count("terminate called")
    return {
        "rc": proc.returncode,
        "aborts": aborts,
        "seconds": round(time.perf_counter() - start, 2),
        "abnormal": proc.returncode != 0 or aborts > 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--strategy", default="bucket_ddp")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", help="write the per-run results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.strategy)
        return
    runs = []
    for i in range(args.runs):
        result = run_once(args.strategy, args.timeout)
        runs.append(result)
        print(
            f"run {i + 1:>3}/{args.runs}: rc={result['rc']} aborts={result['aborts']} "
            f"{result['seconds']}s",
            flush=True,
        )
    abnormal = sum(1 for r in runs if r["abnormal"])
    print(f"{args.strategy}: {abnormal} of {args.runs} runs ended abnormally")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"strategy": args.strategy, "abnormal": abnormal, "runs": runs}, f, indent=2)
    sys.exit(1 if abnormal else 0)


if __name__ == "__main__":
    main()
