"""torchrun's scale-up, with no bucketddp in it: does a second agent join a running job?

``python tools/scaleup_repro.py [--no-share]`` starts one torchrun agent (``--nnodes=1:2``,
one gloo worker, a c10d rendezvous on 127.0.0.1: ``elastic_runs.agent``), waits until its
worker has done 10 all-reduces, then starts a second agent, and reports how both ended and
at which world sizes the workers ran. ``--no-share`` sets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for both.

On torch 2.13 without it, both agents time out after 60 s: the agent that stays rank 0
waits for the new agent's ``torchelastic/role_info/1``, and the new agent waits for the
round's ``MASTER_ADDR``, which the shared-store path publishes only on an agent's first
rendezvous (``dynamic_rendezvous.next_rendezvous``). With it, the first worker restarts at
world size 2 and both finish.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_runs import agent

WORKER = """
import os, sys, time
import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo")
world = dist.get_world_size()
with open(os.path.join(sys.argv[1], f"log.{os.getpid()}"), "a") as log:
    print(f"start world {world}", file=log, flush=True)
    for step in range(300):
        t = torch.ones(1)
        dist.all_reduce(t)
        print(f"step {step} world {int(t.item())}", file=log, flush=True)
        if world == 2 and step == 5:
            break
        time.sleep(0.1)
dist.destroy_process_group()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent(out: Path, port: int, host: bool, env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = [*agent(port, host=host), str(out / "worker.py"), str(out)]
    log = open(out / f"agent{'A' if host else 'B'}.log", "wb")  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def main() -> int:
    """Run the repro once; print the agents' exit codes and the workers' world sizes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-share", action="store_true", help="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    )
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="scaleup-"))
    (out / "worker.py").write_text(WORKER)
    env = dict(os.environ)
    if args.no_share:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    port = _port()
    first = _agent(out, port, True, env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any("step 10 " in p.read_text() for p in out.glob("log.*")):
            break
        time.sleep(0.1)
    second = _agent(out, port, False, env)
    start = time.monotonic()
    codes = [p.wait(timeout=300) for p in (first, second)]
    starts = sorted(
        line
        for p in out.glob("log.*")
        for line in p.read_text().splitlines()
        if line.startswith("start")
    )
    print(
        f"agents exited {codes} in {time.monotonic() - start:.0f} s; "
        f"workers: {starts}; logs in {out}"
    )
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
