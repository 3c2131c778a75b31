"""The engine benchmark's printed tables: one run's figures, and pooled runs' ratios.

Pure printing of what ``bench_stats.summarize`` and ``bench_stats.pool_reports`` return;
``bench_engine.py`` is the command line. See ``docs/benchmarks.md`` for how to read them.
"""

from __future__ import annotations

from typing import Any

from bench_harness import ALLREDUCE, HOOKED, NULL_SYSTEM
from bench_stats import verdict

PAD = " " * 20  # the first column's width: lines below a model's rows start here


def _fmt_size(res: dict[str, Any]) -> str:
    """A model's parameters and parameter tensors, such as "0.93M, 54 tensors"."""
    n = res["params"]
    params = f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.0f}K"
    return f"{params}, {res['tensors']} tensors"


def _fmt_peak(mem: dict[str, Any] | None, local: dict[str, Any] | None) -> str:
    if mem is None:
        return "-"
    text = f"{mem['delta_mb']:+.0f}"
    if local is not None and mem is not local:
        text += f" ({mem['delta_mb'] - local['delta_mb']:+.0f})"
    return text


def print_time_table(
    title: str, results: dict[str, Any], memory: dict[str, Any], *, overhead: bool = False
) -> None:
    """One block per model: step time, spread, exposed communication and peak memory.

    ``overhead`` adds the bucketddp/local line, the figure of the world-size-1 section.
    """
    print(f"\n== {title}")
    width = max([10, *(len(s) for res in results.values() for s in res["systems"])])
    header = (
        f"{'model':<19} {'system':<{width}} {'step ms':>8} {'p25-p75 ms':>13} {'x local':>8} "
        f"{'exposed ms':>10} {'fwd':>6} {'bwd':>6} {'opt':>6} {'wait':>6} {'cpu':>6} "
        f"{'peak MB (vs local)':>19}"
    )
    print(header)
    print("-" * len(header))
    for name, res in results.items():
        figures = res["systems"]
        floor = figures.get("local", {}).get("median_ms")
        labels = [name, _fmt_size(res)]  # down the first column, beside the systems
        for i, (s, f) in enumerate(figures.items()):
            label = labels[i] if i < len(labels) else ""
            rel = f"{f['median_ms'] / floor:.3f}" if floor and s != ALLREDUCE else "-"
            exposed = f"{f['exposed_comm_ms']:+.1f}" if "exposed_comm_ms" in f else "-"
            mem = memory.get(name, {}).get(s)
            peak = _fmt_peak(mem, memory.get(name, {}).get("local"))
            ours = s.partition(HOOKED)[0] == "bucketddp" or s in res.get("variants", {})
            wait = f"{f['comm_wait_ms']:.1f}" if ours else "-"
            phases = [f"{f[k]:6.1f}" for k in ("forward_ms", "backward_ms", "optimizer_ms")]
            if s == ALLREDUCE:  # the wire alone: no phases
                phases = [f"{'-':>6}"] * 3
            print(
                f"{label:<19} {s:<{width}} {f['median_ms']:8.1f} "
                f"{f['p25_ms']:6.1f}-{f['p75_ms']:<6.1f} {rel:>8} {exposed:>10} "
                f"{' '.join(phases)} {wait:>6} {f['cpu_ms']:6.1f} {peak:>19}"
            )
        if "ratio_of_medians" in res:
            ratios = res["round_ratios"]
            lo, hi = res["round_ratio_ci95"]
            print(
                f"{'':<19} bucketddp/torch_ddp: {res['ratio_of_medians']:.3f} (ratio of medians), "
                f"{res['median_round_ratio']:.3f} (median of {len(ratios)} round ratios, "
                f"range {min(ratios):.3f}-{max(ratios):.3f}); cpu {res['cpu_ratio']:.3f}"
            )
            print(
                f"{'':<19} 95% interval of the median round ratio: {lo:.3f}-{hi:.3f}, "
                f"{verdict((lo, hi))}"
            )
            print(f"{'':<19} paired steps: {_paired(res['paired_steps'])}")
        print_beyond_wire(res)
        for hook, v in res.get("hooks", {}).items():
            print(
                f"{PAD}with {hook}: bucketddp/torch_ddp {v['ratio_of_medians']:.3f} (ratio of "
                f"medians), {_ratio(v)}; cpu {v['cpu_ratio']:.3f}; paired steps "
                f"{_paired(v['paired_steps'])}"
            )
        for name, v in res.get("variants", {}).items():
            print_variant(name, v)
        if "null_ratio_of_medians" in res:
            lo, hi = res["null_round_ratio_ci95"]
            print(
                f"{'':<19} null, {NULL_SYSTEM}/torch_ddp: {res['null_ratio_of_medians']:.3f} "
                f"(ratio of medians), {res['null_median_round_ratio']:.3f} (median of round "
                f"ratios), 95% interval {lo:.3f}-{hi:.3f}"
            )
        if "bucketddp_bucket_mb" in res and not overhead:
            print(
                f"{'':<19} buckets (MB, launch order): bucketddp {res['bucketddp_bucket_mb']}, "
                f"torch_ddp {res.get('torch_ddp_bucket_mb') or 'unknown'}"
            )
        if overhead and "bucketddp_over_local" in res:
            print(
                f"{'':<19} bucketddp/local: {res['bucketddp_over_local']:.3f} (ratio of medians), "
                f"{res['bucketddp_over_local_rounds']:.3f} (median of round ratios)"
            )


def _paired(p: dict[str, Any]) -> str:
    """The median of paired step ratios (``bench_stats.paired``), interval and verdict."""
    lo, hi = p["ci95"]
    return (
        f"{p['median']:.3f} (median of {p['n']} step ratios, 95% interval {lo:.3f}-{hi:.3f}, "
        f"{verdict((lo, hi))})"
    )


def _ratio(v: dict[str, Any]) -> str:
    """A comparison's median round ratio, its interval and verdict."""
    lo, hi = v["round_ratio_ci95"]
    return (
        f"{v['median_round_ratio']:.3f} (median of {len(v['round_ratios'])} round ratios, "
        f"95% interval {lo:.3f}-{hi:.3f}, {verdict((lo, hi))})"
    )


def print_beyond_wire(res: dict[str, Any]) -> None:
    """The wire's time and each system's overhead beyond it: step - local - all-reduce."""
    if "wire_ms" not in res:
        return
    beyond = ", ".join(
        f"{s} {f['beyond_wire_ms']:+.1f}"
        for s, f in res["systems"].items()
        if "beyond_wire_ms" in f
    )
    print(
        f"{PAD}wire: all-reduce of {res['gradient_mb']:.1f} MB in one tensor, "
        f"{res['wire_ms']:.1f} ms; beyond the wire (step - local - wire, ms): {beyond}"
    )


def print_variant(name: str, v: dict[str, Any]) -> None:
    """A variant against bucketddp and torch DDP, what the feature it turns off costs, and
    for "auto" what it chose."""
    print(
        f"{PAD}{name}/bucketddp: {v['ratio_of_medians']:.3f} (ratio of medians), "
        f"{_ratio(v)}; cpu {v['cpu_ratio']:.3f}"
    )
    if "vs_torch_ddp" in v:
        print(f"{PAD}  {name}/torch_ddp: {_ratio(v['vs_torch_ddp'])}")
    if "on_off" in v:
        off = ", ".join(f"{k}={val}" for k, val in v["options"].items())
        print(f"{PAD}  cost of what {off} turns off, bucketddp/{name}: {_ratio(v['on_off'])}")
    if v.get("tuning"):
        t = v["tuning"]
        print(
            f"{PAD}  {name} chose bucket_cap_mb={t['bucket_cap_mb']:g}, first_bucket_mb="
            f"{t['first_bucket_mb']:g} in {t['steps']} untimed steps; buckets {v['bucket_mb']}"
        )


def _pooled(series: dict[str, Any], fmt: str = ".3f") -> str:
    lo, hi = series["ci95"]
    return f"{series['median']:{fmt}} ({lo:{fmt}} to {hi:{fmt}}, n={len(series['values'])})"


def print_pooled(pooled: dict[str, Any], runs: int) -> None:
    """``--pool``'s output: per model, the pooled ratios, the wire and the variants."""
    print(f"bucketddp/torch_ddp pooled over {runs} runs")
    for section, models in pooled.items():
        print(f"\n== {section.replace('_', ' ')}")
        for model, e in models.items():
            lo, hi = e["round_ratio_ci95"]
            per_run = ", ".join(f"{r:.3f}" for r in e["ratio_of_medians"])
            print(
                f"{model:<16} median of {len(e['round_ratios'])} round ratios "
                f"{e['median_round_ratio']:.3f}, 95% interval {lo:.3f}-{hi:.3f}, "
                f"{verdict((lo, hi))}; ratio of medians per run: {per_run}"
            )
            for hook, p in e.get("paired_steps", {}).items():
                with_hook = f" with {hook}" if hook else ""
                print(f"{'':<16} paired steps{with_hook}: {_paired(p)}")
            if "null_round_ratios" in e:
                lo, hi = e["null_round_ratio_ci95"]
                print(
                    f"{'':<16} null, {NULL_SYSTEM}/torch_ddp: median of "
                    f"{len(e['null_round_ratios'])} round ratios {e['null_median_round_ratio']:.3f}"
                    f", 95% interval {lo:.3f}-{hi:.3f} (from {len(e['null_ratio_of_medians'])} of "
                    f"the {e['runs']} runs)"
                )
            if "wire_ms" in e:
                print(f"{'':<16} wire ms: {_pooled(e['wire_ms'], '.1f')}")
                for s, series in e.get("beyond_wire_ms", {}).items():
                    print(
                        f"{'':<16} beyond the wire, {s} ms: {series['of_medians']:+.1f} (of the "
                        f"medians); per round {_pooled(series, '+.1f')}"
                    )
            for hook, series in e.get("hooks", {}).items():
                print(f"{'':<16} with {hook}: bucketddp/torch_ddp {_pooled(series)}")
            for name, v in e.get("variants", {}).items():
                line = f"{'':<16} {name}/bucketddp {_pooled(v['bucketddp'])}"
                if "vs_torch_ddp" in v:
                    line += f"; /torch_ddp {_pooled(v['vs_torch_ddp'])}"
                if "on_off" in v:
                    line += f"; bucketddp/{name} (the cost) {_pooled(v['on_off'])}"
                print(line)
                for t in v.get("tuned", []):
                    print(
                        f"{'':<16}   chose {t['bucket_cap_mb']:g}/{t['first_bucket_mb']:g} MB "
                        f"in {t['steps']} steps"
                    )
