"""EngineOptions: the engine's options, checked once, without processes."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch

from bucketddp import BucketDataParallel
from bucketddp.options import EngineOptions


def test_defaults_are_torch_ddps() -> None:
    options = EngineOptions()
    assert (options.bucket_cap_mb, options.first_bucket_mb) == (25.0, 1.0)
    assert options.buffer_policy_default == "broadcast"
    assert options.unused_hint == "Pass find_unused_parameters=True"
    assert EngineOptions(bucket_cap_mb=None, first_bucket_mb=None) == options  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "kind", "message"),
    [
        ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be a positive, finite number"),
        ({"first_bucket_mb": "1"}, TypeError, "first_bucket_mb must be a number of megabytes"),
        ({"static_graph": "False"}, TypeError, "static_graph must be True or False, got str"),
        ({"broadcast_buffers": 2}, TypeError, "broadcast_buffers must be True, False or None"),
        ({"buffer_sync": ["a"]}, TypeError, r"buffer_sync is a list \(\['a'\]\); use a dict"),
        ({"default_buffer_policy": "avg"}, ValueError, "unknown buffer policy 'avg'"),
        ({"default_buffer_policy": 3}, TypeError, "neither a policy name"),
        (
            {"broadcast_buffers": False, "default_buffer_policy": "mean"},
            ValueError,
            "broadcast_buffers=False contradicts default_buffer_policy='mean'",
        ),
    ],
)
def test_bad_options_fail_at_construction(
    given: dict[str, Any], kind: type[Exception], message: str
) -> None:
    with pytest.raises(kind, match=message):
        EngineOptions(**given)
    with pytest.raises(kind, match=message):
        EngineOptions().replace(**given)


def test_first_bucket_is_never_larger_than_the_others() -> None:
    # Left out, it is 1 MB, or the cap if smaller (torch DDP: the cap, if one is given).
    assert EngineOptions(bucket_cap_mb=0.5).first_bucket_mb == 0.5
    assert EngineOptions(bucket_cap_mb=4).replace(bucket_cap_mb=0.25).first_bucket_mb == 0.25
    assert EngineOptions(bucket_cap_mb=0.5, first_bucket_mb=0.5).first_bucket_mb == 0.5
    message = r"first_bucket_mb=8.0 is larger than bucket_cap_mb=4.0: the first bucket is the small"
    with pytest.raises(ValueError, match=message):
        EngineOptions(bucket_cap_mb=4, first_bucket_mb=8)
    with pytest.raises(ValueError, match=r"Pass first_bucket_mb <= 4.0, or leave it out"):
        EngineOptions(first_bucket_mb=8).replace(bucket_cap_mb=4)
    with pytest.raises(ValueError, match=r"first_bucket_mb=2.0 is larger than bucket_cap_mb=1.0"):
        # Checked before any process group is needed.
        BucketDataParallel(torch.nn.Linear(2, 2), bucket_cap_mb=1.0, first_bucket_mb=2.0)


def test_buffer_policy_default_follows_the_switches() -> None:
    assert EngineOptions(broadcast_buffers=False).buffer_policy_default == "none"
    assert EngineOptions(forward_sync_buffers=False).buffer_policy_default == "none"
    assert EngineOptions(default_buffer_policy="max").buffer_policy_default == "max"


def test_rules_are_a_frozen_copy_and_options_copy_and_pickle() -> None:
    rules = {"*.running_*": "mean"}
    options = EngineOptions(buffer_sync=rules, bucket_cap_mb=4)
    rules["other"] = "max"
    assert options.buffer_sync == {"*.running_*": "mean"}
    with pytest.raises(TypeError):
        options.buffer_sync["x"] = "sum"  # type: ignore[index]
    for copied in (copy.deepcopy(options), pickle.loads(pickle.dumps(options))):
        assert copied == options and hash(copied) == hash(options)
        assert copied.buffer_sync == {"*.running_*": "mean"}
    assert options.keywords()["buffer_sync"] == {"*.running_*": "mean"}
    assert "unused_hint" not in options.keywords()


def test_options_object_and_engine_keywords_are_exclusive() -> None:
    options = EngineOptions(bucket_cap_mb=4)
    assert EngineOptions.from_keywords(options, bucket_cap_mb=None, static_graph=False) is options
    with pytest.raises(TypeError, match="bucket_cap_mb, static_graph given together with opt"):
        EngineOptions.from_keywords(options, bucket_cap_mb=4, static_graph=True)
    with pytest.raises(TypeError, match="options must be an EngineOptions or None, got dict"):
        EngineOptions.from_keywords({"bucket_cap_mb": 4})  # type: ignore[arg-type]
    # Refused before anything else, so no process group is needed to see it.
    with pytest.raises(TypeError, match=r"find_unused_parameters given together with options="):
        BucketDataParallel(torch.nn.Linear(2, 2), options=options, find_unused_parameters=True)


def test_stall_timeout_is_seconds_or_none() -> None:
    assert EngineOptions().stall_timeout == 600.0
    assert EngineOptions(stall_timeout=None).stall_timeout is None
    with pytest.raises(ValueError, match="stall_timeout must be a positive, finite number"):
        EngineOptions(stall_timeout=0)
    with pytest.raises(TypeError, match="stall_timeout must be a number of seconds or None"):
        EngineOptions(stall_timeout="60")
    with pytest.raises(TypeError, match="watchdog must be True or False"):
        EngineOptions(watchdog="no")
