"""A few fixed seeds of the Lightning strategy's fuzzer (``tools/fuzz_lightning.py``),
so that it keeps working; tests/distributed/test_fuzz.py does the same for the engine's.

The fuzzer itself runs outside the suite: ``python3 dev.py fuzz-lightning --schedules 100``.
"""

from __future__ import annotations

import fuzz_lightning

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
