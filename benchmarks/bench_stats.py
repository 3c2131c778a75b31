"""The engine benchmark's statistics: medians, ratios, bootstrap intervals and pooling.

Pure functions of the figures ``bench_harness.time_model`` returns, and of earlier runs'
JSON reports: nothing here runs a model.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Sequence
from typing import Any

from bench_harness import ALLREDUCE, NULL_SYSTEM, counterparts
from bucketddp.options import EngineOptions


def median(xs: Sequence[float]) -> float:
    """The median of ``xs``; NaN for none."""
    return statistics.median(xs) if xs else float("nan")


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs``, interpolated linearly; NaN for none."""
    ordered = sorted(xs)
    if not ordered:
        return float("nan")
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def bootstrap_ci(
    xs: Sequence[float], *, level: float = 0.95, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``xs`` (deterministic for one seed).

    Resamples ``xs`` with replacement, takes each resample's median and returns the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of those medians.
    """
    if not xs:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    medians = [statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples)]
    tail = (1 - level) / 2
    return quantile(medians, tail), quantile(medians, 1 - tail)


def verdict(ci: tuple[float, float]) -> str:
    """Read a ratio's interval: below 1 is faster, above 1 slower, across 1 within noise."""
    lo, hi = ci
    if hi < 1:
        return "faster"
    if lo > 1:
        return "slower"
    return "within noise"


STEP_RESAMPLES = 1000
"""Bootstrap resamples for the paired step ratios (hundreds to thousands of them)."""


def step_ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> list[float]:
    """Each timed step of ``ours`` over the same step of ``theirs``, round by round.

    The systems take turns step by step (``bench_harness.time_model``), so the two steps of
    a pair ran milliseconds apart, on the same batch, under the same load.
    """
    return [
        a / b
        for rounds in zip(ours["step_ms"], theirs["step_ms"], strict=True)
        for a, b in zip(*rounds, strict=True)
    ]


def paired(ratios: Sequence[float]) -> dict[str, Any]:
    """The median of paired step ratios, its 95% interval and how many there are."""
    return {
        "median": median(ratios),
        "ci95": list(bootstrap_ci(ratios, resamples=STEP_RESAMPLES)),
        "n": len(ratios),
    }


def _compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Step-time ratios of one system's figures over another's: pooled, per round and per
    paired step."""
    round_ratios = [
        a / b for a, b in zip(ours["round_medians_ms"], theirs["round_medians_ms"], strict=True)
    ]
    return {
        "ratio_of_medians": ours["median_ms"] / theirs["median_ms"],
        "median_round_ratio": median(round_ratios),
        "round_ratios": round_ratios,
        "round_ratio_ci95": list(bootstrap_ci(round_ratios)),
        "paired_steps": paired(step_ratios(ours, theirs)),
    }


def summarize(raw: dict[str, Any], systems: Sequence[str]) -> dict[str, Any]:
    """Medians, ratios and exposed communication of one model's timing run (in ms)."""
    per_round = raw["per_round"]
    out: dict[str, Any] = {
        "params": raw["params"],
        "tensors": raw["tensors"],
        "steps_per_round": raw.get("steps_per_round"),
        "probe_step_ms": raw.get("probe_step_ms"),
        "systems": {},
    }
    for s in systems:
        rounds = per_round[s]
        steps = [row for rnd in rounds for row in rnd]
        totals = [1000 * row[0] for row in steps]
        out["systems"][s] = {
            "median_ms": median(totals),
            "p25_ms": quantile(totals, 0.25),
            "p75_ms": quantile(totals, 0.75),
            "round_medians_ms": [median([1000 * row[0] for row in rnd]) for rnd in rounds],
            "forward_ms": median([1000 * row[1] for row in steps]),
            "backward_ms": median([1000 * row[2] for row in steps]),
            "optimizer_ms": median([1000 * row[3] for row in steps]),
            "comm_wait_ms": median([1000 * row[4] for row in steps]),
            "cpu_ms": median([1000 * row[5] for row in steps]),
            "step_ms": [[1000 * row[0] for row in rnd] for rnd in rounds],
        }
    figures = out["systems"]
    engines = [s for s in systems if s not in ("local", ALLREDUCE)]
    if "local" in figures:
        floor = figures["local"]["median_ms"]
        for s in engines:
            figures[s]["exposed_comm_ms"] = figures[s]["median_ms"] - floor
    if "local" in figures and ALLREDUCE in figures:
        # The floor: the step without communication plus the wire alone. What a system
        # takes beyond it is its own work, and the communication it failed to overlap.
        local, wire = figures["local"], figures[ALLREDUCE]
        out["wire_ms"] = wire["median_ms"]
        out["gradient_mb"] = raw.get("gradient_mb")
        for s in engines:
            f = figures[s]
            f["beyond_wire_ms"] = f["median_ms"] - local["median_ms"] - wire["median_ms"]
            f["beyond_wire_round_ms"] = [
                a - b - c
                for a, b, c in zip(
                    f["round_medians_ms"],
                    local["round_medians_ms"],
                    wire["round_medians_ms"],
                    strict=True,
                )
            ]
    if "torch_ddp" in figures and "bucketddp" in figures:
        out.update(_compare(figures["bucketddp"], figures["torch_ddp"]))
        out["cpu_ratio"] = figures["bucketddp"]["cpu_ms"] / figures["torch_ddp"]["cpu_ms"]
    if "torch_ddp" in figures and NULL_SYSTEM in figures:
        null = _compare(figures[NULL_SYSTEM], figures["torch_ddp"])
        out.update({f"null_{key}": value for key, value in null.items()})
    if "local" in figures and "bucketddp" in figures:
        out["bucketddp_over_local"] = (
            figures["bucketddp"]["median_ms"] / figures["local"]["median_ms"]
        )
        out["bucketddp_over_local_rounds"] = median(
            [
                a / b
                for a, b in zip(
                    figures["bucketddp"]["round_medians_ms"],
                    figures["local"]["round_medians_ms"],
                    strict=True,
                )
            ]
        )
    # Each hook: bucketddp with it against torch DDP with it.
    out["hooks"] = {}
    for theirs, s, hook in counterparts(systems):
        if hook:
            out["hooks"][hook] = {
                **_compare(figures[s], figures[theirs]),
                "cpu_ratio": figures[s]["cpu_ms"] / figures[theirs]["cpu_ms"],
            }
    # Each variant against plain bucketddp (what its options cost) and torch DDP; one that
    # turns a default-on feature off also gives that feature's cost, bucketddp over it.
    out["variants"] = {}
    for name, options in raw.get("variant_options", {}).items():
        if name in figures and "bucketddp" in figures:
            ours, base = figures[name], figures["bucketddp"]
            entry = out["variants"][name] = {
                **_compare(ours, base),
                "cpu_ratio": ours["cpu_ms"] / base["cpu_ms"],
                "options": options,
                "bucket_mb": raw.get("variant_bucket_mb", {}).get(name),
                "tuning": raw.get("variant_tuning", {}).get(name),
            }
            if "torch_ddp" in figures:
                entry["vs_torch_ddp"] = _compare(ours, figures["torch_ddp"])
            if turns_off(options):
                entry["on_off"] = _compare(base, ours)
    kept = ("bucketddp_buckets", "bucketddp_bucket_mb", "bucketddp_collectives")
    for key in (*kept, "torch_ddp_bucket_mb"):
        if key in raw:
            out[key] = raw[key]
    return out


def turns_off(options: dict[str, Any]) -> bool:
    """Whether a variant's options only switch off features that are on by default."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineOptions)}
    return bool(options) and all(v is False and defaults.get(k) is True for k, v in options.items())


POOL_KEYS = (
    "interleaved",
    "steps",
    "warmup",
    "min_round_ms",
    "batch_size",
    "bucket_cap_mb",
    "first_bucket_mb",
    "comm_hook",
)
"""Config entries that must agree between pooled runs (rounds and models may differ)."""


def pool_reports(reports: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Pool the round ratios of several runs' JSON reports, per section and model.

    Raises ValueError, naming the file, if a report was made with other step counts,
    batch size or bucket options than the first one: their ratios do not measure the same
    thing.
    """
    for name, report in reports:
        if not isinstance(report, dict) or "config" not in report:
            raise ValueError(f"{name}: not a report of bench_engine.py (it has no 'config')")
    first_name, first = reports[0]
    pooled: dict[str, Any] = {}
    for name, report in reports:
        for key in POOL_KEYS:
            if report["config"].get(key) != first["config"].get(key):
                raise ValueError(
                    f"{name}: {key} is {report['config'].get(key)!r}, but "
                    f"{first['config'].get(key)!r} in {first_name}; pool only runs made with "
                    "the same options"
                )
        for section in ("world_size_2", "world_size_1"):
            for model, res in report.get(section, {}).items():
                if "round_ratios" not in res:
                    continue
                entry = pooled.setdefault(section, {}).setdefault(model, {"runs": 0})
                entry["runs"] += 1
                for prefix in ("", "null_"):  # bucketddp's ratios, then the null's if run
                    if f"{prefix}round_ratios" in res:
                        entry.setdefault(f"{prefix}round_ratios", []).extend(
                            res[f"{prefix}round_ratios"]
                        )
                        entry.setdefault(f"{prefix}ratio_of_medians", []).append(
                            res[f"{prefix}ratio_of_medians"]
                        )
                _pool_extras(entry, res)
    for models in pooled.values():
        for entry in models.values():
            for prefix in ("", "null_"):
                if f"{prefix}round_ratios" in entry:
                    ratios = entry[f"{prefix}round_ratios"]
                    entry[f"{prefix}median_round_ratio"] = median(ratios)
                    entry[f"{prefix}round_ratio_ci95"] = list(bootstrap_ci(ratios))
            for series in _series(entry):
                series["median"] = median(series["values"])
                series["ci95"] = list(bootstrap_ci(series["values"]))
            for key, series in entry.get("paired_steps", {}).items():
                entry["paired_steps"][key] = paired(series["values"])
            steps = entry.pop("step_ms", None)
            if steps is not None:
                # As in one run's table: the medians of all steps, local's and the wire's off.
                floor = median(steps["local"]) + median(steps[ALLREDUCE])
                for s, series in entry["beyond_wire_ms"].items():
                    series["of_medians"] = median(steps[s]) - floor
    return pooled


def _pool_extras(entry: dict[str, Any], res: dict[str, Any]) -> None:
    """Add one run's per-round wire, beyond-the-wire and variant figures to ``entry``."""

    def extend(where: dict[str, Any], key: str, values: Sequence[float]) -> None:
        where.setdefault(key, {"values": []})["values"].extend(values)

    systems = res.get("systems", {})
    for theirs, ours, key in counterparts(list(systems)):
        entry.setdefault("paired_steps", {}).setdefault(key, {"values": []})["values"].extend(
            step_ratios(systems[ours], systems[theirs])
        )
    if ALLREDUCE in systems:
        extend(entry, "wire_ms", systems[ALLREDUCE]["round_medians_ms"])
        for s, f in systems.items():  # every timed step, for the medians of all runs
            entry.setdefault("step_ms", {}).setdefault(s, []).extend(
                ms for rnd in f["step_ms"] for ms in rnd
            )
    for s, f in systems.items():
        if "beyond_wire_round_ms" in f:
            extend(entry.setdefault("beyond_wire_ms", {}), s, f["beyond_wire_round_ms"])
    for hook, v in res.get("hooks", {}).items():
        extend(entry.setdefault("hooks", {}), hook, v["round_ratios"])
    for name, v in res.get("variants", {}).items():
        pooled = entry.setdefault("variants", {}).setdefault(name, {"options": v["options"]})
        extend(pooled, "bucketddp", v["round_ratios"])
        for key in ("vs_torch_ddp", "on_off"):
            if key in v:
                extend(pooled, key, v[key]["round_ratios"])
        if v.get("tuning"):
            pooled.setdefault("tuned", []).append(v["tuning"])


def _series(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The pooled value lists of ``_pool_extras`` in ``entry``, to summarize."""
    out = [entry["wire_ms"]] if "wire_ms" in entry else []
    out += list(entry.get("beyond_wire_ms", {}).values())
    out += list(entry.get("hooks", {}).values())
    for v in entry.get("variants", {}).values():
        out += [v[key] for key in ("bucketddp", "vs_torch_ddp", "on_off") if key in v]
    return out
