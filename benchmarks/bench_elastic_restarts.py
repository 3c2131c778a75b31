"""``bench_elastic.py``'s torchrun jobs: the recovery time after a kill, and the picture.

Each job runs ``elastic_job.py`` under real torchrun agents on this machine, in one of
three scenarios:

- ``straight``: one agent, 2 workers, nothing killed;
- ``rank``: one agent, 2 workers (``--standalone --max-restarts=1``); rank 1 SIGKILLs
  itself, the agent stops the other worker and starts both again;
- ``node``: two agents of one worker each (``--nnodes=1:2``, c10d rendezvous on
  localhost); one worker SIGKILLs its agent and itself, so that node is lost, and the
  other agent's worker fails, is restarted, and goes on alone at world size 1;
- ``node_quick``: the same, with agents that drop a silent agent after 3 s, not 15;
- ``grow``: the ``node`` job, and once the survivor has done ``GROW_AT`` steps alone, a
  third agent joins: the workers go on at world size 2 (``--grow``'s picture).

The recovery time runs from the kill (the victim logs the time just before) to the first
step the restarted workers complete, split at the milestones ``elastic_job.py`` logs,
each the slowest worker's. ``draw`` makes ``docs/images/elastic-run.png`` from a
``straight`` and a ``node`` job of the picture's model.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import bench_harness  # noqa: F401  (puts tools/, elastic_runs' and multirank's folder, on sys.path)
from bench_stats import median
from elastic_runs import agent, standalone, start
from multirank import free_port

HERE = Path(__file__).resolve().parent
JOB = HERE / "elastic_job.py"
RECOVERY_KILL = 12
"""The recovery jobs' victim dies once 12 of their 24 steps are done."""
PICTURE_KILL = 80
"""The picture's victim dies once 80 steps are done: mid-way through the second epoch."""
GROW_AT = 140
"""In the ``grow`` picture, a node joins once 140 steps are done: the third epoch, at world
size 1 since step 80."""
SCENARIOS = {
    "rank": "a rank killed: one agent, 2 workers",
    "node": "a node lost: two agents of 1 worker, one killed with its worker",
    "node_quick": "the same, the agents with --rdzv-conf keep_alive_interval=1",
}
QUICK_KEEP_ALIVE = "keep_alive_interval=1"
"""``node_quick``'s rendezvous option: an agent that stops beating is dropped after 3 s
(3 beats missed), not torchrun's default 15 s (5 s a beat)."""
PHASES = (
    ("failed", "the surviving worker's step raises (its peer is gone)"),
    ("exited", "the surviving worker exits (bucketddp names the dead peer)"),
    ("process", "torchrun starts the workers again (rendezvous included)"),
    ("started", "interpreter start"),
    ("imported", "imports (torch, bucketddp)"),
    ("group", "process group formed"),
    ("data", "model and data made"),
    ("wrapped", "BucketDataParallel (its weights broadcast)"),
    ("optimizer", "optimizer (the first one imports torch._dynamo)"),
    ("built", "loader and Elastic"),
    ("resumed", "snapshot agreed on, read and sent"),
    ("first_step", "first step after the restart"),
)
"""The milestones after a kill, in order, and what happens before each."""


def _wait(procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout: float) -> list[int]:
    """Each process's exit code; all are killed with their sessions if one outlives
    ``timeout`` seconds, which raises with its log's tail."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        late = next(log for p, log in zip(procs, logs, strict=True) if p.poll() is None)
        tail = late.read_text()[-3000:]
        raise RuntimeError(f"{late} did not finish in {timeout:.0f}s:\n{tail}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def run_job(scenario: str, mode: str, out: Path, shm: Path, timeout: float = 600) -> None:
    """Run ``elastic_job.py MODE`` in ``scenario`` (see the module docstring), its logs in
    ``out`` and its snapshots under ``shm``; raises unless the job ends well."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    kill = str(RECOVERY_KILL if mode == "recovery" else PICTURE_KILL)
    job = [str(JOB), mode, str(out), kill]
    env = {"BUCKETDDP_SNAPSHOT_DIR": str(shm)}
    if scenario == "grow":
        codes = _grow(job, out, env)
        ok = codes == [0, -signal.SIGKILL, 0]
        logs = [out / "agent-survivor.log"]
    elif scenario.startswith("node"):
        port = free_port()
        conf = f",{QUICK_KEEP_ALIVE}" if scenario == "node_quick" else ""
        logs = [out / "agent-survivor.log", out / "agent-victim.log"]
        victim = {**env, "ELASTIC_VICTIM": "node"}
        procs = [
            start([*agent(port, host=True, conf=conf), *job], logs[0], env),  # the store's
            start([*agent(port, host=False, conf=conf), *job], logs[1], victim),
        ]
        codes = _wait(procs, logs, timeout)
        ok = codes == [0, -signal.SIGKILL]
    else:
        logs = [out / "torchrun.log"]
        victim = {"ELASTIC_VICTIM": "rank1"} if scenario == "rank" else {}
        cmd = [*standalone(restarts=0 if scenario == "straight" else 1), *job]
        codes = _wait([start(cmd, logs[0], {**env, **victim})], logs, timeout)
        ok = codes == [0]
    if not ok:
        raise RuntimeError(f"the {scenario} job exited {codes}; see {logs[0]}")


def _grow(job: list[str], out: Path, env: dict[str, str], timeout: float = 600) -> list[int]:
    """The ``grow`` scenario: two agents, one lost at ``PICTURE_KILL`` with its worker; when
    the other's worker, alone, has done ``GROW_AT`` steps, a third agent joins. The agents
    share no store with their workers (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), without
    which torchrun's join deadlocks. Each agent's exit code."""
    port = free_port()
    env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    logs = [out / f"agent-{name}.log" for name in ("survivor", "victim", "joiner")]
    procs = [
        start([*agent(port, host=True), *job], logs[0], {**env, "ELASTIC_GROW_AT": str(GROW_AT)}),
        start([*agent(port, host=False), *job], logs[1], {**env, "ELASTIC_VICTIM": "node"}),
    ]
    deadline = time.monotonic() + timeout
    while not (out / "waiting").exists():
        if procs[0].poll() is not None or time.monotonic() > deadline:
            _wait(procs, logs[:2], 0.1)
            raise RuntimeError(f"the survivor never waited for a joiner; see {logs[0]}")
        time.sleep(0.1)
    procs.append(start([*agent(port, host=False), *job], logs[2], env))
    return _wait(procs, logs, timeout)


def events(out: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """``elastic_job.py``'s logs in ``out``: per attempt and rank, each milestone's time,
    and ``steps``: (step, world size, loss, time) of each step done."""
    found: dict[int, dict[int, dict[str, Any]]] = {}
    for path in out.glob("events.rank*.attempt*"):
        rank, attempt = (int(x) for x in path.name.removeprefix("events.rank").split(".attempt"))
        mine: dict[str, Any] = {"steps": []}
        for line in path.read_text().splitlines():
            t, what, *rest = line.split()
            if what == "step":
                mine["steps"].append((int(rest[0]), int(rest[1]), float(rest[2]), float(t)))
            else:
                mine[what] = float(t)
        found.setdefault(attempt, {})[rank] = mine
    return found


def recovery_split(log: dict[int, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Seconds from the kill to each milestone (the slowest worker's; None for a milestone
    none logged), and the steps done before the kill and resumed from."""
    killed = min(r["kill"] for r in log[0].values() if "kill" in r)
    after = log[1]
    at: dict[str, float | None] = {}
    for name in ("failed", "exited"):  # only a worker that saw the failure logs them
        seen = [r[name] for r in log[0].values() if "failed" in r and name in r]
        at[name] = max(seen) - killed if seen else None
    for name, _ in PHASES[2:]:
        if name == "first_step":
            at[name] = max(r["steps"][0][3] for r in after.values()) - killed
        else:
            at[name] = max(r[name] for r in after.values()) - killed
    done = max(s for r in log[0].values() for s, *_ in r["steps"])
    resumed = min(s for r in after.values() for s, *_ in r["steps"]) - 1
    return {"at": at, "steps_before_kill": done, "resumed_from": resumed}


def recovery_main(runs: int, shm_root: Path, results: Path) -> dict[str, Any]:
    """``--recovery``: ``runs`` jobs of each scenario; each milestone's median."""
    report: dict[str, Any] = {}
    for scenario in SCENARIOS:
        found = []
        for i in range(runs):
            out = results / f"recovery-{scenario}{i}"
            run_job(scenario, "recovery", out, shm_root / out.name)
            found.append(recovery_split(events(out)))
            print(
                f"  recovery, {scenario} run {i}: {found[-1]['at']['first_step']:.2f}s", flush=True
            )
        phases = {}
        for name, _ in PHASES:
            values = [f["at"][name] for f in found if f["at"][name] is not None]
            phases[name] = {"seconds": median(values) if values else None, "runs": values}
        report[scenario] = {"runs": found, "phases": phases}
    return report


def print_recovery(report: dict[str, Any]) -> None:
    """Per scenario: the median seconds from the kill to each milestone, and each phase."""
    for scenario, rec in report.items():
        print(f"\n== {SCENARIOS[scenario]}")
        print(f"{'from the kill until':<58} {'s, median':>9} {'phase s':>8}  runs (s)")
        previous = 0.0
        for name, text in PHASES:
            p = rec["phases"][name]
            if p["seconds"] is None:
                continue
            runs = " ".join(f"{x:.2f}" for x in p["runs"])
            print(f"{text:<58} {p['seconds']:>9.2f} {p['seconds'] - previous:>8.2f}  {runs}")
            previous = p["seconds"]
        redone = [f["steps_before_kill"] - f["resumed_from"] for f in rec["runs"]]
        print(f"steps done twice, per run: {redone}")


def picture_main(shm_root: Path, results: Path, image: Path, grow: bool = False) -> dict[str, Any]:
    """``--picture`` (``--grow``): the picture model's job uninterrupted, then losing a node
    (and, with ``grow``, gaining one back); draws both."""
    figures: dict[str, Any] = {}
    scenario = "grow" if grow else "node"
    for name in ("straight", scenario):
        out = results / f"picture-{name}"
        run_job(name, "picture", out, shm_root / out.name)
        log = events(out)
        figures[name] = losses(log)
        if name == "node":
            figures[name]["recovery"] = recovery_split(log)
    draw(figures, scenario, image)
    return figures


def losses(log: dict[int, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """A job's (step, world size, mean loss), attempt after attempt (the steps an attempt
    did again replace the last one's), and the step each restart resumed from."""
    rows: list[tuple[int, int, float]] = []
    restarts = []
    for attempt in sorted(log):
        steps = sorted({s[:3] for r in log[attempt].values() for s in r["steps"]})
        if rows and steps:
            restarts.append(steps[0][0] - 1)
            rows = [row for row in rows if row[0] < steps[0][0]]
        rows += steps
    return {"steps": rows, "restarts": restarts}


def draw(figures: dict[str, Any], scenario: str, image: Path) -> None:
    """Loss against step for both jobs, each change of world size as a vertical line;
    workers below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ws) = plt.subplots(
        2, 1, figsize=(8, 4.6), sharex=True, gridspec_kw={"height_ratios": [4, 1]}
    )
    rows = figures[scenario]["steps"]
    changes = [(b[0] - 1, b[1]) for a, b in itertools.pairwise(rows) if a[1] != b[1]]
    what = " and".join(
        f" {'regained' if world > 1 else 'lost'} after step {step}" for step, world in changes
    )
    styles = {  # the uninterrupted job on top: until the change, both are the same
        scenario: (f"a node{what}", "tab:blue", 1),
        "straight": ("uninterrupted, 2 workers", "0.35", 2),
    }
    for key, (label, color, z) in styles.items():
        steps = [r[0] for r in figures[key]["steps"]]
        ax.plot(
            steps, [r[2] for r in figures[key]["steps"]], color=color, lw=0.9, label=label, zorder=z
        )
        ws.step(
            steps,
            [r[1] for r in figures[key]["steps"]],
            where="post",
            color=color,
            lw=1.5,
            zorder=z,
        )
    for i, (step, world) in enumerate(changes):
        for a in (ax, ws):
            a.axvline(step, color="tab:red", ls="--", lw=1)
        text = (
            f"a node joins: torchrun restarts the workers,\nwhich resume from step {step}'s "
            "snapshot\nat world size 2"
            if world > 1
            else f"restart: torchrun starts the survivor again,\nwhich resumes from step "
            f"{step}'s snapshot\nat world size 1"
        )
        ax.annotate(
            text,
            (step, 0.62 - 0.2 * i),
            xycoords=("data", "axes fraction"),
            xytext=(8, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
            color="tab:red",
        )
    ax.set_ylabel("training loss, mean over workers")
    ax.legend(loc="upper right", fontsize=8, frameon=False)
    title = "a node lost, then one joins" if scenario == "grow" else "a node lost mid-epoch"
    ax.set_title(f"Elastic training under torchrun: {title}", fontsize=10)
    ws.set_ylabel("workers")
    ws.set_yticks([1, 2])
    ws.set_ylim(0.5, 2.5)
    ws.set_xlabel("optimizer step (an epoch is 64 steps on 2 workers, 128 on 1)")
    fig.tight_layout()
    image.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(image, dpi=120)
    plt.close(fig)
    print(f"wrote {image}")
