"""bucket_cap_mb="auto" times each candidate on the whole step, the rebuild left out."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from bucketddp.reducer import tuning


class Plan(list):  # type: ignore[type-arg]
    """A stand-in bucket plan: buckets with names and sizes, and an order."""

    order = ("w",)


def fake_reducer() -> Any:
    """What the tuner reads of the reducer: a plan per cap, one collective-free rank (the
    test gives it ``use_caps``)."""

    def plan(cap: int, first: int, order: Any) -> Plan:
        return Plan([SimpleNamespace(names=(f"cap {cap}",), nbytes=8 * tuning.MB)])

    r = SimpleNamespace(observed=None, world_size=1, caps=(0, 0), m=SimpleNamespace(plan=plan))
    r.plan = plan(0, 0, None)
    return r


def test_each_candidate_is_timed_from_the_end_of_the_last_step_after_its_rebuild(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = {"now": 0.0}
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock["now"])

    r = fake_reducer()

    def use_caps(caps: tuple[int, int]) -> None:
        if caps != r.caps:
            clock["now"] += 5.0  # a slow rebuild, which no candidate must be charged for
            r.caps, r.plan = caps, r.m.plan(*caps, r.plan.order)

    r.use_caps = use_caps
    tuner = tuning.BucketTuner(r, None, None)
    tuner.after_step(joining=False)  # the first synced step: plans the candidates
    n = len(tuner._pairs)
    assert n >= 2
    # Candidate k's steps take 1 + k seconds, end of backward to end of backward.
    while not tuner.done:
        clock["now"] += 1.0 + (tuner._step - 1) % n
        tuner.after_step(joining=False)
    assert [m for _, m in tuner.medians] == [1.0 + k for k in range(n)]
    assert tuner.choice == tuner._pairs[0]
