"""The words of the fault reports: pure functions of the records on the board."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_STACKS = 8  # ranks whose stacks a stall report prints in full


class RankFailedError(RuntimeError):
    """Another rank failed, so this one stops: the message names the rank and its error."""


class RankStalledError(RuntimeError):
    """Some rank made no progress for longer than the stall timeout; names it, with stacks."""


def who(record: dict[str, Any]) -> str:
    """``rank 1 (host h, pid 123)``."""
    return f"rank {record['rank']} (host {record.get('host', '?')}, pid {record.get('pid', '?')})"


def where(record: dict[str, Any]) -> str:
    """`` after step 5's forward`` or `` at step 5, in backward`` ("" if unknown)."""
    if "step" not in record:
        return ""
    step = record["step"]
    phase = record.get("phase") or "?"
    if not step:
        return f" before its first training step ({phase})"
    if phase == "user code":
        return f" after step {step}'s forward"
    return f" at step {step}, in {phase}"


def cause(record: dict[str, Any]) -> str:
    """What happened to the rank of a fault record, in one sentence."""
    kind = record["kind"]
    if kind == "raised":
        return f"{who(record)} failed{where(record)}: {record['type']}: {record['message']}"
    if kind == "signal":
        return (
            f"{who(record)} was killed by signal {record['signal']}{where(record)} "
            f"(seen by its parent process, rank {record['seen_by']})"
        )
    if kind == "unreachable" and record.get("agent"):
        return (
            "the rendezvous store, which torchrun's agent on the first node hosts, stopped "
            "answering: that agent likely stopped (its node lost) or is ending the workers"
        )
    if kind == "unreachable":
        return (
            f"rank {record['rank']} hosts the rendezvous store, which stopped answering: "
            "it likely died (killed by a signal or the OOM killer) or exited"
        )
    last = f" (its last heartbeat came{where(record)})" if "step" in record else ""
    return (
        f"{who(record)} died without reporting an error{last}: no sign of life for "
        f"{record.get('silent_s', 0):.0f} s, so it was likely killed by a signal or the OOM "
        "killer (or it exited without an error bucketddp could see)"
    )


def origins(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The faults that started it: those not caused by another rank's, one per rank."""
    firsts = [r for r in records if not r.get("secondary")] or list(records)
    seen: set[int] = set()
    out = []
    for record in firsts:
        if record["rank"] not in seen:
            seen.add(record["rank"])
            out.append(record)
    return out


def failed_message(rank: int, records: Sequence[dict[str, Any]]) -> str:
    """The error of a rank that stops because of the faults in ``records``."""
    causes = origins(records)
    text = "; ".join(cause(r) for r in causes)
    more = (
        " The failed rank's own output has its traceback."
        if any(r["kind"] == "raised" for r in causes)
        else ""
    )
    return f"rank {rank} stops because {text}.{more} Every rank of the job stops."


def stall_culprits(reports: Sequence[dict[str, Any]], world_size: int) -> list[int]:
    """The ranks the others wait for: not waiting themselves, or behind, or silent."""
    by_rank = {r["rank"]: r for r in reports}
    silent = [rank for rank in range(world_size) if rank not in by_rank]
    idle = [r["rank"] for r in reports if not r["waiting"]]
    if idle or silent:
        return sorted(idle + silent)
    least = min(r["step"] for r in reports)
    return sorted(r["rank"] for r in reports if r["step"] == least)


def stall_message(
    rank: int, reports: Sequence[dict[str, Any]], world_size: int, timeout: float
) -> str:
    """The error every rank raises on a stall: who stalled, where, and every rank's stacks."""
    culprits = stall_culprits(reports, world_size)
    by_rank = {r["rank"]: r for r in reports}
    named = ", ".join(
        f"{who(by_rank[c])}{where(by_rank[c])}: {by_rank[c]['detail']}"
        if c in by_rank
        else f"rank {c} (did not answer: stuck outside Python, or its watchdog is off)"
        for c in culprits
    )
    lines = [
        f"rank {rank} stops: no progress for over {timeout:g} s (stall_timeout). Stalled: {named}.",
        "Every rank:",
    ]
    for r in sorted(reports, key=lambda r: r["rank"]):
        state = "waits on the others" if r["waiting"] else "is not in a collective"
        lines.append(f"  {who(r)}{where(r)}: {r['detail']}; {state}, idle {r['idle']:.0f} s")
    shown = [r for r in sorted(reports, key=lambda r: r["rank"]) if r["rank"] in culprits]
    shown += [r for r in sorted(reports, key=lambda r: r["rank"]) if r["rank"] not in culprits]
    for r in shown[:MAX_STACKS]:
        lines.append(f"Python stacks of rank {r['rank']} (faulthandler):\n{r['stacks'].rstrip()}")
    if len(shown) > MAX_STACKS:
        lines.append(f"(stacks of {len(shown) - MAX_STACKS} more ranks left out)")
    return "\n".join(lines)
