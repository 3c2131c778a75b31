"""A few fixed seeds of the fuzzers, so that they keep working: the engine's
(``tests/support/fuzz_engine.py``) and the Lightning strategy's
(``tests/support/fuzz_lightning.py``).

The fuzzers themselves run outside the suite: ``python3 dev.py fuzz --schedules 200`` and
``python3 dev.py fuzz-lightning --schedules 100``.
"""

from __future__ import annotations

import fuzz_lightning
from fuzz_engine import make_schedule, run_seeds

# Chosen for what they cover (checked below). World size 2: 1, static_graph, a comm hook,
# SyncBatchNorm and a Stats block under nine buffer rules (exact and patterns) and a
# default policy; 58, uneven join() with no_sync(), a rank-dependent branch, a custom
# default policy on BatchNorm and a layer run twice, the trunk under one plain checkpoint;
# 89, a layer frozen at wrapping and unfrozen, with a comm hook and SyncBatchNorm; 427,
# static_graph with a layer in two reentrant checkpoint segments and the head in a third,
# behind a forward that returns an object the output hooks do not open. World size 3: 60,
# a layer unfrozen and frozen again under uneven join(), with no_sync(), a sparse embedding
# and every buffer policy; 205, the ranks finishing one after another under join(), with
# forward_sync_buffers=False, a "*" rule and a reentrant checkpoint.
SEEDS = (1, 58, 89, 427, 60, 205)


def test_the_smoke_seeds_cover_the_main_features() -> None:
    covered = set().union(*(make_schedule(seed).features() for seed in SEEDS))
    needed = {"join", "uneven", "no_sync", "freeze_switch", "frozen_at_wrap", "hook", "world3"}
    needed |= {"static_graph", "bn", "sparse", "branch", "find_unused_parameters", "no_view"}
    needed |= {"stats", "syncbn", "buffer_pattern", "default_policy", "forward_sync"}
    needed |= {"p_sum", "p_mean", "p_max", "p_min", "p_none", "p_custom", "rank_local"}
    needed |= {"ckpt_plain", "ckpt_reentrant", "head_ckpt", "several_grads", "opaque", "repeat"}
    assert needed <= covered, (
        f"{sorted(needed - covered)} no longer covered: make_schedule changed, pick new seeds"
    )


def test_fuzz_schedules_match_one_process_on_the_global_batch() -> None:
    failed = [
        f"seed {s.seed} ({s.short()}):\n{out.detail}"
        for s, out in run_seeds(SEEDS, group=len(SEEDS))
        if not out.ok
    ]
    assert not failed, "\n".join(failed)


# Lightning: 4, manual optimization accumulating through toggle_model, with BatchNorm, a
# layer used twice, one some ranks skip and one no rank runs, resumed from a checkpoint
# after one step; 15, static_graph with the fp16 hook, a layer used twice and one no rank
# runs; 49, bf16-mixed with BatchNorm, the rank-dependent layer, allreduce_hook and
# clipping; 7, accumulate_grad_batches=2 with BatchNorm, resumed after one step; 100,
# three ranks (a launch of its own), BatchNorm, allreduce_hook, bf16-mixed and
# accumulate_grad_batches=3, resumed after two steps.
LIGHTNING_SEEDS = (4, 15, 49, 7, 100)


def test_the_lightning_smoke_seeds_cover_the_main_features() -> None:
    drawn = [fuzz_lightning.make_schedule(seed) for seed in LIGHTNING_SEEDS]
    assert any(s.manual and s.accumulate > 1 for s in drawn)
    assert any(not s.manual and s.accumulate > 1 for s in drawn)
    assert any(s.options["static_graph"] for s in drawn)
    assert any(s.precision == "bf16-mixed" for s in drawn)
    assert any(s.clip is not None for s in drawn)
    assert {s.hook for s in drawn} >= {"fp16", "allreduce"}
    assert any(s.resume_at is not None and s.bn for s in drawn)
    assert {s.world for s in drawn} == {2, 3}
    assert all(any(getattr(s, f) for s in drawn) for f in ("bn", "twice", "branch", "spare"))


def test_lightning_fuzz_schedules_give_the_weights_of_ddp() -> None:
    outcomes = fuzz_lightning.run_launch(list(LIGHTNING_SEEDS), timeout=300)
    failed = [f"seed {seed}: {detail}" for seed, (ok, detail) in outcomes.items() if not ok]
    assert not failed, "\n".join(failed)
