"""The picture of docs/benchmarks.md's ratio table: bucketddp / torch DDP per model and hook.

Draws ``docs/images/ratios.png`` from a JSON report of ``bench_engine.py`` (its world-size-2
section): for each model, the median of the paired step ratios bucketddp / torch DDP
without a hook and with each hook the run timed (``--hooks``), with their 95% bootstrap
intervals; for reports made before the systems took turns step by step, the median of the
per-round ratios. Nothing is measured here.

Usage::

    .venv/bin/python benchmarks/bench_engine.py --world-size 2 --no-memory
    .venv/bin/python benchmarks/bench_ratio_plot.py benchmarks/results/engine.json
    .venv/bin/python benchmarks/bench_ratio_plot.py run1.json run2.json run3.json  # pooled
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench_stats import pool_reports

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "docs" / "images" / "ratios.png"
NO_HOOK = "no hook"


def paired_figures(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per hook (``""`` for none): the paired step figures of one run's or a pooled entry."""
    figures = res.get("paired_steps") or {}
    if "median" not in figures:
        return dict(figures)  # pooled (bench_stats.pool_reports): already per hook
    hooks = res.get("hooks", {}).items()
    return {"": figures, **{h: e["paired_steps"] for h, e in hooks if "paired_steps" in e}}


def ratio_rows(section: dict[str, Any]) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Per model, per hook (``NO_HOOK`` first): (median ratio, interval low, high).

    The paired step ratios where the report has them, else the round ratios.
    """
    rows: dict[str, dict[str, tuple[float, float, float]]] = {}
    for model, res in section.items():
        per: dict[str, tuple[float, float, float]] = {}
        paired = paired_figures(res)
        if paired:
            for hook, p in paired.items():
                per[hook or NO_HOOK] = (p["median"], *p["ci95"])
            rows[model] = per
            continue
        if "round_ratio_ci95" in res:
            per[NO_HOOK] = (res["median_round_ratio"], *res["round_ratio_ci95"])
        for hook, e in res.get("hooks", {}).items():
            if "ci95" in e:  # pooled (bench_stats.pool_reports)
                per[hook] = (e["median"], *e["ci95"])
            else:
                per[hook] = (e["median_round_ratio"], *e["round_ratio_ci95"])
        rows[model] = per
    return rows


def draw(rows: dict[str, dict[str, tuple[float, float, float]]], path: Path, title: str) -> None:
    """Grouped bars, one group per model, one bar per hook, with interval whiskers."""
    hooks = list(dict.fromkeys(h for per in rows.values() for h in per))
    width = 0.8 / max(1, len(hooks))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows)), 3.8))
    for j, hook in enumerate(hooks):
        xs, ys, lo, hi = [], [], [], []
        for i, per in enumerate(rows.values()):
            if hook in per:
                y, low, high = per[hook]
                xs.append(i - 0.4 + (j + 0.5) * width)
                ys.append(y)
                lo.append(y - low)
                hi.append(high - y)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=hook)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), list(rows), rotation=20, ha="right")
    ax.set_ylabel("step time, bucketddp / torch DDP")
    spans = [v for per in rows.values() for v in per.values()]
    ax.set_ylim(min(0.7, *(v[1] for v in spans)) - 0.02, max(1.2, *(v[2] for v in spans)))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=len(hooks), loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Read the report, draw the picture."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "json", type=Path, nargs="+", help="JSON reports of bench_engine.py; several are pooled"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    args = p.parse_args(argv)
    reports = [(str(path), json.loads(path.read_text())) for path in args.json]
    if len(reports) == 1:
        section = reports[0][1].get("world_size_2")
    else:
        try:
            section = pool_reports(reports).get("world_size_2")
        except ValueError as e:
            print(f"bench_ratio_plot: {e}", file=sys.stderr)
            return 2
    if not section:
        print("bench_ratio_plot: no world-size-2 section to draw", file=sys.stderr)
        return 2
    per_model = [
        sum(r["config"]["rounds"] for _, r in reports if model in r.get("world_size_2", {}))
        for model in section
    ]
    low, high = min(per_model), max(per_model)
    rounds = f"{low}" if low == high else f"{low} to {high} (per model)"
    runs = f" ({len(reports)} runs pooled)" if len(reports) > 1 else ""
    paired = all(paired_figures(res) for res in section.values())
    what = "paired step ratios" if paired else "round ratios"
    title = (
        f"median of the {what} of {rounds} interleaved rounds{runs}, 95% intervals; "
        "below 1: bucketddp faster"
    )
    draw(ratio_rows(section), args.out, title)
    print(f"wrote {args.out} ({what})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
