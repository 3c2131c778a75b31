"""Do errors end a user's processes with exit code 1, never a signal? Count it over runs.

    python benchmarks/error_exit_status.py --runs 30                    # bucketddp
    python benchmarks/error_exit_status.py --runs 30 --wrapper ddp      # torch DDP
    python benchmarks/error_exit_status.py --runs 30 --scenario unused  # error in backward

A run is a plain 2-rank script over gloo that fails on both ranks and lets its error
reach the top level, without ``destroy_process_group``, as a hand-written loop does:

- ``mismatch``: the ranks build different models, so wrapping raises;
- ``unused``: a parameter gets no gradient, so the end of backward raises.

A run is abnormal when a rank ends other than with exit code 1: a signal (SIGABRT from
"terminate called without an active exception"), another code, or a hang.

Each rank is a new ``python`` process, as under torchrun: the SIGABRT came from the
interpreter's shutdown, so every run must end a process. (Several runs in one process
would not do: no run but the last would exit. Ranks forked from a launcher that imported
torch once did not reproduce it in 20 runs, and were hardly faster.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any


def scenario(name: str, wrapper: str) -> None:
    """What each rank runs: join the group, wrap, fail. Reads torchrun's variables."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    Wrapper: Any  # either wrapper; bucketddp is imported only for its own runs
    if wrapper == "ours":
        from bucketddp import BucketDataParallel as Wrapper
    else:
        from torch.nn.parallel import DistributedDataParallel as Wrapper
    if name == "mismatch":
        Wrapper(nn.Linear(4, 3 + 2 * rank))
        return
    model = Wrapper(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    for _ in range(2):  # torch DDP raises at the forward after the bad backward
        model(torch.ones(2, 4))  # the output goes unused: only the first layer gets gradients
        model.module[0](torch.ones(2, 4)).sum().backward()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(port: int, rank: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": "2",
    }


def _start_rank(port: int, rank: int, log: str, args: argparse.Namespace) -> int:
    cmd = [sys.executable, os.path.abspath(__file__), "--rank-child"]
    cmd += ["--scenario", args.scenario, "--wrapper", args.wrapper]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, **_env(port, rank)}, stdout=out, stderr=out)
    return proc.pid


def _wait(pids: list[int], timeout: float) -> list[int | str]:
    """Each rank's exit code, or "SIGxxx" for a signal, or "timeout" (then killed)."""
    ends: dict[int, int | str] = {}
    deadline = time.monotonic() + timeout
    while len(ends) < len(pids):
        for pid in pids:
            if pid in ends:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                ends[pid] = code if code >= 0 else signal.Signals(-code).name
        if time.monotonic() > deadline:
            for pid in set(pids) - set(ends):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                ends[pid] = "timeout"
        time.sleep(0.01)
    return [ends[pid] for pid in pids]


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def run_once(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """One run of both ranks; returns their ends and whether one was abnormal."""
    start = time.perf_counter()
    port = _port()
    logs = [os.path.join(tmp, f"rank{r}.log") for r in range(2)]
    codes = _wait([_start_rank(port, r, logs[r], args) for r in range(2)], args.timeout)
    texts = [_read(log) for log in logs]
    aborts = sum(t.count("terminate called") for t in texts)
    abnormal = any(c != 1 for c in codes) or aborts > 0
    return {
        "codes": codes,
        "aborts": aborts,
        "seconds": round(time.perf_counter() - start, 2),
        "abnormal": abnormal,
        "errors": [t.strip().splitlines()[-1:] for t in texts],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--scenario", choices=["mismatch", "unused"], default="mismatch")
    parser.add_argument("--wrapper", choices=["ours", "ddp"], default="ours")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--json", help="write the per-run results here")
    parser.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_child:
        scenario(args.scenario, args.wrapper)
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            runs.append(run_once(args, tmp))
            r = runs[-1]
            print(f"run {i + 1:>3}/{args.runs}: exit {r['codes']} {r['seconds']}s", flush=True)
    abnormal = sum(r["abnormal"] for r in runs)
    label = f"{args.wrapper} {args.scenario}"
    print(f"{label}: {abnormal} of {args.runs} runs ended abnormally")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": label, "abnormal": abnormal, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
