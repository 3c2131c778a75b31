"""The engine benchmark as users run it: one short real run on 2 gloo ranks.

Timings are not checked (they live in the benchmark's output, not in tests). What is checked
is what the benchmark reports about the two engines: with default options bucketddp and
torch DDP reduce the same buckets, read from torch DDP's own logging data, and the bucket
options reach bucketddp.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import itertools
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_engine.py"
HARNESS = SCRIPT.parent / "bench_harness.py"
# Three steps in all: torch DDP reports its rebuilt buckets from its third forward on.
# No hooked systems (--hooks without a value), but in the test of --hooks.
SHORT = [
    *("--rounds", "1", "--steps", "1", "--warmup", "2", "--world-size", "2", "--no-memory"),
    *("--min-round-ms", "0", "--hooks"),
]
WITH_MEMORY = [a for a in SHORT if a != "--no-memory"]


def run_bench(tmp_path: Path, *extra: str, short: list[str] = SHORT) -> dict[str, Any]:
    """Run the benchmark script on the transformer; returns its timed rounds' JSON report."""
    out = tmp_path / "engine.json"
    cmd = [sys.executable, str(SCRIPT), "--models", "transformer", *short, *extra]
    proc = subprocess.run(
        [*cmd, "--json", str(out)], capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bucketddp/torch_ddp" in proc.stdout
    report: dict[str, Any] = json.loads(out.read_text())
    return report["world_size_2"]["transformer"]


@pytest.mark.jobs  # a run of the benchmark script
def test_default_buckets_match_torch_ddp_and_peak_memory_is_the_median_of_fresh_pairs(
    tmp_path: Path,
) -> None:
    # One run checks both, to keep the suite short: the timed rounds with default options,
    # then the memory pairs (a fresh pair of processes per system and repeat).
    out = tmp_path / "engine.json"
    memory_args = ["--memory-steps", "1", "--memory-repeats", "3"]
    result = run_bench(tmp_path, *memory_args, short=WITH_MEMORY)
    memory = json.loads(out.read_text())["memory_world_size_2"]["transformer"]
    assert set(memory) == {"local", "torch_ddp", "bucketddp"}
    for system in memory.values():
        pairs = system["repeats_delta_mb"]
        assert len(pairs) == 3 and system["delta_mb"] == statistics.median(pairs)
        assert len(system["per_rank_delta_mb"]) == 2

    theirs = result["torch_ddp_bucket_mb"]
    if theirs is None:
        pytest.skip("this torch's DDP does not report its rebuilt bucket sizes")
    assert len(theirs) >= 2  # a small first bucket, then the rest
    assert result["bucketddp_bucket_mb"] == pytest.approx(theirs, abs=0.01)
    assert set(result["systems"]) == {"local", "torch_ddp", "bucketddp", "allreduce"}
    lo, hi = result["round_ratio_ci95"]
    assert lo <= result["median_round_ratio"] <= hi


@pytest.mark.jobs  # a run of the benchmark script
def test_a_bucket_cap_gives_both_engines_the_same_buckets_and_variants_their_options(
    tmp_path: Path,
) -> None:
    # torch 2.13 makes its first bucket as large as an explicit bucket_cap_mb; before, the
    # benchmark left bucketddp's at 1 MB and compared different buckets. A variant is a
    # bucketddp with engine options of its own, timed in the same rounds.
    variant = "bucketddp_finite:check_finite=True,first_bucket_mb=0.5"
    result = run_bench(tmp_path, "--bucket-cap-mb", "2", "--variant", variant)
    finite = result["variants"]["bucketddp_finite"]
    assert finite["options"] == {"check_finite": True, "first_bucket_mb": 0.5}
    assert finite["round_ratios"] == [
        a / b
        for a, b in zip(
            result["systems"]["bucketddp_finite"]["round_medians_ms"],
            result["systems"]["bucketddp"]["round_medians_ms"],
            strict=True,
        )
    ]
    theirs = result["torch_ddp_bucket_mb"]
    if theirs is None:
        pytest.skip("this torch's DDP does not report its rebuilt bucket sizes")
    assert result["bucketddp_bucket_mb"] == pytest.approx(theirs, abs=0.01)
    assert theirs[0] > 1.5  # not a 1 MB first bucket


@pytest.mark.jobs  # a run of the benchmark script
def test_first_bucket_comm_hook_null_and_malloc_options_reach_the_run(tmp_path: Path) -> None:
    # One bucket with the fp16 hook: one call for the bucket, with the flags riding in its
    # buffer (docs/comm-hooks.md), so one collective. torch DDP takes the same hook (it
    # would raise on an unknown one), and so does the null system, a second torch DDP.
    # The memory pairs run under --malloc-mmap-kb, which every rank must apply.
    extra = ["--first-bucket-mb", "25", "--comm-hook", "fp16", "--null"]
    memory_args = ["--memory-steps", "1", "--memory-repeats", "1", "--malloc-mmap-kb", "64"]
    result = run_bench(tmp_path, *extra, *memory_args, short=WITH_MEMORY)
    memory = json.loads((tmp_path / "engine.json").read_text())["memory_world_size_2"]
    assert {s["malloc_mmap_kb"] for s in memory["transformer"].values()} == {64}
    assert result["bucketddp_buckets"] == 1
    assert result["bucketddp_collectives"] == 1
    assert set(result["systems"]) == {"local", "allreduce", "torch_ddp", "bucketddp", "torch_ddp_b"}
    ours, null = result["systems"]["torch_ddp_b"], result["systems"]["torch_ddp"]
    assert result["null_round_ratios"] == [
        a / b for a, b in zip(ours["round_medians_ms"], null["round_medians_ms"], strict=True)
    ]


@pytest.mark.jobs  # a run of the benchmark script
def test_hooks_time_each_hook_on_both_wrappers_in_the_same_rounds(tmp_path: Path) -> None:
    short = [a for a in SHORT if a != "--hooks"]
    result = run_bench(tmp_path, "--hooks", "fp16", "powersgd", short=short)
    hooked = {"torch_ddp+fp16", "bucketddp+fp16", "torch_ddp+powersgd", "bucketddp+powersgd"}
    assert set(result["systems"]) == {"local", "allreduce", "torch_ddp", "bucketddp", *hooked}
    assert set(result["hooks"]) == {"fp16", "powersgd"}
    for hook, ratios in result["hooks"].items():
        ours, theirs = (result["systems"][f"{s}+{hook}"] for s in ("bucketddp", "torch_ddp"))
        assert ratios["round_ratios"] == [
            a / b for a, b in zip(ours["round_medians_ms"], theirs["round_medians_ms"], strict=True)
        ]
        # Paired steps: each of ours over torch DDP's step on the same batch, in turn.
        pairs = [a / b for a, b in zip(ours["step_ms"][0], theirs["step_ms"][0], strict=True)]
        assert ratios["paired_steps"]["n"] == len(pairs) == 1
        assert ratios["paired_steps"]["median"] == pairs[0]
    pooled = run_pool(tmp_path / "engine.json", tmp_path / "engine.json")
    assert pooled.returncode == 0, pooled.stderr
    assert "paired steps with fp16: " in pooled.stdout
    assert "median of 2 step ratios" in pooled.stdout


@pytest.mark.jobs  # a run of the benchmark script
def test_a_model_with_short_steps_times_more_of_them_per_round(tmp_path: Path) -> None:
    # --min-round-ms: the probe's step (untimed, every system, the slowest rank's median)
    # sets the timed steps per round, at least --steps and at most 16 times as many; the
    # default SHORT runs (0) time exactly --steps.
    result = run_bench(tmp_path, "--min-round-ms", "60", "--steps", "2")
    probe, steps = result["probe_step_ms"], result["steps_per_round"]
    assert probe > 0
    assert steps == min(max(2, math.ceil(60 / probe)), 32)
    for system in result["systems"].values():
        assert [len(rnd) for rnd in system["step_ms"]] == [steps]
    plain = run_bench(tmp_path, "--steps", "2")
    assert plain["probe_step_ms"] is None and plain["steps_per_round"] == 2
    assert [len(rnd) for rnd in plain["systems"]["bucketddp"]["step_ms"]] == [2]


@pytest.mark.jobs  # a run of the benchmark script
def test_overheads_time_the_wire_and_tune_auto_before_the_timed_rounds(tmp_path: Path) -> None:
    # --overheads adds the variants that turn telemetry and the watchdog off, the finite
    # check and "auto" sizes; the rounds also time the wire, a standalone all-reduce. "auto"
    # is tuned in untimed steps first. Pooling the run with itself carries all of it along.
    result = run_bench(tmp_path, "--overheads")
    systems = result["systems"]
    assert {"allreduce", "bucketddp_auto", "bucketddp_no_watchdog"} <= set(systems)
    for s in ("torch_ddp", "bucketddp", "bucketddp_auto"):
        f = systems[s]
        assert f["beyond_wire_ms"] == pytest.approx(
            f["median_ms"] - systems["local"]["median_ms"] - result["wire_ms"]
        )
    variants = result["variants"]
    assert "on_off" in variants["bucketddp_no_telemetry"]
    assert "on_off" not in variants["bucketddp_finite"]
    auto = variants["bucketddp_auto"]
    assert auto["options"] == {"bucket_cap_mb": "auto"} and "vs_torch_ddp" in auto
    assert auto["tuning"]["steps"] >= 2 and auto["tuning"]["bucket_cap_mb"] > 0
    proc = run_pool(tmp_path / "engine.json", tmp_path / "engine.json")
    assert proc.returncode == 0, proc.stderr
    assert "beyond the wire, bucketddp ms:" in proc.stdout
    assert "bucketddp_no_watchdog/bucketddp" in proc.stdout and "(the cost)" in proc.stdout


def test_each_bucketddp_system_steps_next_to_its_torch_ddp_taking_turns_first() -> None:
    hooked = ["torch_ddp+fp16", "bucketddp+fp16"]
    systems = ["local", "torch_ddp", "bucketddp", "allreduce", *hooked, "bucketddp_finite"]
    turn_order = load_bench().turn_order
    orders = [[turn_order(systems, r, k) for k in range(4)] for r in range(8)]
    for order in (o for steps in orders for o in steps):
        assert sorted(order) == sorted(systems)
        for theirs, ours in (("torch_ddp", "bucketddp"), tuple(hooked)):
            assert abs(order.index(theirs) - order.index(ours)) == 1
    # Who goes first alternates from step to step, starting the other way each round, so
    # that both go first right after whatever runs before the pair, in every round.
    ours_first = [[o.index("bucketddp") < o.index("torch_ddp") for o in steps] for steps in orders]
    assert ours_first == [[False, True] * 2, [True, False] * 2] * 4
    # The five units (two pairs, three singles) keep one order within a round, and rotate
    # from round to round.
    partners = ("bucketddp", "bucketddp+fp16")
    units = [[[s for s in o if s not in partners] for o in steps] for steps in orders]
    assert all(steps.count(steps[0]) == len(steps) for steps in units)
    assert len({steps[0][0] for steps in units}) == 5


@functools.cache
def load_bench() -> Any:
    """The benchmark's harness as a module, importing its own ``models`` (not the tests')."""
    saved = sys.modules.pop("models", None)  # tests/support/models.py, if a test imported it
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("bench_harness", HARNESS)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look themselves up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
        sys.modules.pop("models", None)
        if saved is not None:
            sys.modules["models"] = saved
    return module


@pytest.mark.parametrize("count", [2, 3, 4, 5])
def test_round_order_balances_positions_and_predecessors(count: int) -> None:
    systems = [f"s{i}" for i in range(count)]
    cycle = count if count % 2 == 0 else 2 * count
    rounds = [load_bench().round_order(systems, r) for r in range(cycle)]
    assert all(sorted(order) == systems for order in rounds)
    positions = collections.Counter((s, i) for order in rounds for i, s in enumerate(order))
    follows = collections.Counter(pair for order in rounds for pair in itertools.pairwise(order))
    # Every system in every position, and directly after every other, equally often.
    assert len(positions) == count * count and len(set(positions.values())) == 1
    assert len(follows) == count * (count - 1) and len(set(follows.values())) == 1


def test_the_deep_transformer_has_about_300_small_tensors_and_trains() -> None:
    # The benchmark's many-tensor model, where a hook per parameter costs the most: it keeps
    # its shape, and one step runs (in this process; the bench runs it like the others).
    harness = load_bench()
    spec = harness.MODELS["deep_transformer"]
    model = spec.build(seed=0)
    per_layer = [p.numel() for p in model.encoder.layers[0].parameters()]
    assert harness.count_tensors(model) == 306
    assert len(per_layer) == 12 and max(per_layer) <= 16 * 1024
    harness.loss_fn(model, spec.batch()).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bad_bucket_size_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--bucket-cap-mb", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "--bucket-cap-mb must be positive" in proc.stderr


def test_cuda_without_a_gpu_per_rank_is_refused() -> None:
    import torch

    gpus = torch.cuda.device_count()
    if gpus >= 2:
        pytest.skip("this machine has a GPU for each rank of world size 2")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda"],  # world sizes 2 and 1
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    want = "sees no CUDA GPU" if gpus == 0 else "one NCCL rank per GPU and this machine has 1"
    assert want in proc.stderr
    if gpus == 1:
        assert "pass --world-size 1" in proc.stderr


def fake_report(
    path: Path, round_ratios: list[float], null: list[float] | None = None, **config: Any
) -> Path:
    """A minimal report in the benchmark's JSON layout, for the pooling mode."""
    cfg = {"steps": 8, "warmup": 2, "batch_size": None, "bucket_cap_mb": None}
    cfg |= {"first_bucket_mb": None, **config}
    result = {"round_ratios": round_ratios, "ratio_of_medians": statistics.median(round_ratios)}
    if null is not None:
        result |= {"null_round_ratios": null, "null_ratio_of_medians": statistics.median(null)}
    path.write_text(json.dumps({"config": cfg, "world_size_2": {"transformer": result}}))
    return path


def run_pool(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--pool", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_pool_combines_the_round_ratios_of_several_runs(tmp_path: Path) -> None:
    a = fake_report(tmp_path / "a.json", [0.90, 0.95], null=[1.02, 0.98])
    b = fake_report(tmp_path / "b.json", [0.97])  # made without --null
    proc = run_pool(a, b)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("transformer"))
    assert "median of 3 round ratios 0.950" in lines[at]
    assert "95% interval 0.900-0.970, faster" in lines[at]
    assert "ratio of medians per run: 0.925, 0.970" in lines[at]
    assert "torch_ddp_b/torch_ddp: median of 2 round ratios 1.000" in lines[at + 1]
    assert "(from 1 of the 2 runs)" in lines[at + 1]


def test_pool_refuses_runs_made_with_other_options(tmp_path: Path) -> None:
    a = fake_report(tmp_path / "a.json", [0.99])
    b = fake_report(tmp_path / "b.json", [1.01], first_bucket_mb=25.0)
    proc = run_pool(a, b)
    assert proc.returncode == 2
    assert "b.json: first_bucket_mb is 25.0" in proc.stderr


def test_variant_arguments_are_checked_by_name() -> None:
    parse = load_bench().parse_variant
    assert parse("fast:check_finite=True, bucket_cap_mb=4,default_buffer_policy=mean") == (
        "fast",
        (("check_finite", True), ("bucket_cap_mb", 4), ("default_buffer_policy", "mean")),
    )
    for text, message in (
        ("check_finite=True", "expected NAME:option=value"),
        ("bucketddp:check_finite=True", "a built-in system"),
        ("x:check_finit=True", "unknown engine option 'check_finit'"),
        ("x:check_finite=yes", "check_finite must be True or False, got str 'yes'"),
        ("x:bucket_cap_mb=0", "bucket_cap_mb must be a positive, finite number"),
    ):
        with pytest.raises(ValueError, match=message):
            parse(text)
