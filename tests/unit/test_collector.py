"""Python's cyclic collector held off while a snapshot is taken (``elastic/collector.py``).

A state of a few thousand tensors, taken apart as a snapshot takes it, makes the collector
run when it is on (the ground truth that the test can fail), and not once inside
``held_off``; the collector is on again after the block, and stays off if it was off.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

from bucketddp.elastic.collector import held_off
from bucketddp.skeleton import split_tensors


@pytest.fixture
def collections() -> Iterator[list[int]]:
    seen: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    yield seen
    gc.callbacks.remove(count)


def _take_apart() -> int:
    base = torch.zeros(3000)
    state = {"model": {f"w{i}": base[i : i + 1].detach() for i in range(3000)}, "step": 7}
    return len(split_tensors(state)[1])


def test_taking_a_state_apart_starts_no_collection_while_held_off(
    collections: list[int],
) -> None:
    assert gc.isenabled()
    assert _take_apart() == 3000
    assert collections, "3,000 tensors alive at once should have started a collection"
    collections.clear()
    with held_off():
        assert not gc.isenabled()
        assert _take_apart() == 3000
    assert gc.isenabled()
    assert collections == []


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    try:
        with held_off():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
