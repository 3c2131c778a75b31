"""What the interpreter-start hook (bucketddp-strategy-names.pth) costs every Python program.

    python benchmarks/startup_cost.py --runs 200

Runs ``python -X importtime -c pass`` in turns with the hook on and switched off
(``BUCKETDDP_NO_STARTUP_HOOK=1``), in the environment of the ``python`` running this script,
and prints the medians: the whole start-up's wall time, and the cumulative import time
``-X importtime`` reports for ``_bucketddp_startup`` (the one module the hook loads; switched
off, the hook reads one environment variable and loads nothing). The wall-time difference
is noise-bound on a busy machine; the import time is the hook's own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def one_start(hook: bool) -> tuple[float, float]:
    """One start-up: its wall time (ms) and the hook module's import time (ms, 0 if none)."""
    env = dict(os.environ)
    env.pop("BUCKETDDP_NO_STARTUP_HOOK", None)
    if not hook:
        env["BUCKETDDP_NO_STARTUP_HOOK"] = "1"
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "pass"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    wall = (time.perf_counter() - start) * 1e3
    hook_us = 0
    for line in done.stderr.splitlines():
        # "import time: self [us] | cumulative | imported package"
        if line.split("|")[-1].strip() == "_bucketddp_startup":
            hook_us = int(line.split("|")[1])
    return wall, hook_us / 1e3


def main() -> None:
    """Interleave the two kinds of start-up and print their medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="start-ups of each kind")
    args = parser.parse_args()
    on: list[tuple[float, float]] = []
    off: list[tuple[float, float]] = []
    for _ in range(args.runs):
        on.append(one_start(True))
        off.append(one_start(False))
    wall_on = statistics.median(w for w, _ in on)
    wall_off = statistics.median(w for w, _ in off)
    module = statistics.median(m for _, m in on)
    if module == 0:
        sys.exit("startup_cost: the hook did not load: is bucketddp installed here?")
    print(f"{args.runs} start-ups each, interleaved ({sys.executable})")
    print(f"median start-up, hook on:  {wall_on:.2f} ms")
    print(f"median start-up, hook off: {wall_off:.2f} ms")
    print(f"difference: {wall_on - wall_off:+.2f} ms ({(wall_on / wall_off - 1) * 100:+.1f}%)")
    print(f"median import time of _bucketddp_startup (-X importtime): {module * 1e3:.0f} us")


if __name__ == "__main__":
    main()
