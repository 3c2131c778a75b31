"""The bucket planner is pure: tested without processes."""

from __future__ import annotations

import pytest
import torch

from bucketddp.buckets import MB, ParamInfo, cap_bytes, plan_buckets
from bucketddp.options import check_bucket_sizes

CPU = torch.device("cpu")


def p(name: str, numel: int, dtype: torch.dtype = torch.float32) -> ParamInfo:
    return ParamInfo(name, numel, dtype, CPU)


def names(plan) -> list[tuple[str, ...]]:  # type: ignore[no-untyped-def]
    return [b.names for b in plan]


def test_reverse_registration_order_with_small_first_bucket() -> None:
    params = [p("a", 100), p("b", 100), p("c", 100), p("d", 100)]  # 400 bytes each
    plan = plan_buckets(params, cap_bytes=800, first_cap_bytes=400)
    assert names(plan) == [("d",), ("c", "b"), ("a",)]
    assert [b.numel for b in plan] == [100, 200, 100]
    assert [b.nbytes for b in plan] == [400, 800, 400]
    assert [b.index for b in plan] == [0, 1, 2]
    assert not plan.learned
    assert plan.order == ("d", "c", "b", "a")


def test_dtypes_never_mix_and_each_group_gets_a_first_bucket() -> None:
    params = [p("a", 10), p("b", 10, torch.float64), p("c", 10), p("d", 10, torch.float64)]
    plan = plan_buckets(params, cap_bytes=10 * MB, first_cap_bytes=10 * MB)
    assert sorted(names(plan)) == [("c", "a"), ("d", "b")]
    for b in plan:
        assert len({b.dtype}) == 1
    dtypes = {b.names: b.dtype for b in plan}
    assert dtypes[("d", "b")] == torch.float64
    assert dtypes[("c", "a")] == torch.float32


def test_devices_never_mix() -> None:
    meta = torch.device("meta")
    params = [ParamInfo("a", 4, torch.float32, CPU), ParamInfo("b", 4, torch.float32, meta)]
    plan = plan_buckets(params, cap_bytes=MB, first_cap_bytes=MB)
    assert {(b.names, b.device) for b in plan} == {(("b",), meta), (("a",), CPU)}


def test_observed_order_is_followed_and_unlisted_params_come_last() -> None:
    params = [p("a", 100), p("b", 100), p("c", 100), p("d", 100)]
    plan = plan_buckets(params, cap_bytes=400, first_cap_bytes=400, order=["b", "a"])
    assert plan.order == ("b", "a", "d", "c")
    assert names(plan) == [("b",), ("a",), ("d",), ("c",)]
    assert plan.learned


def test_buckets_sorted_by_when_their_last_gradient_arrives() -> None:
    # float64 "x" closes its bucket late; float32 buckets that close earlier come first.
    params = [p("x", 10, torch.float64), p("a", 100), p("b", 100), p("c", 100)]
    plan = plan_buckets(params, cap_bytes=400, first_cap_bytes=400, order=["x", "a", "b", "c"])
    # The float64 bucket never fills, so it is closed at the end: its last (only) member
    # came first, so it is launched first.
    assert names(plan)[0] == ("x",)
    assert names(plan)[1:] == [("a",), ("b",), ("c",)]


def test_every_parameter_is_planned_exactly_once() -> None:
    params = [p(f"w{i}", 7 * i + 1, torch.float32 if i % 3 else torch.float16) for i in range(40)]
    plan = plan_buckets(params, cap_bytes=64, first_cap_bytes=16)
    planned = [n for b in plan for n in b.names]
    assert sorted(planned) == sorted(x.name for x in params)
    assert sum(b.numel for b in plan) == sum(x.numel for x in params)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        plan_buckets([p("a", 1)], cap_bytes=0, first_cap_bytes=1)
    with pytest.raises(ValueError, match="'a' appears twice"):
        plan_buckets([p("a", 1), p("a", 2)], cap_bytes=1, first_cap_bytes=1)
    with pytest.raises(ValueError, match="unknown parameters \\['z'\\]"):
        plan_buckets([p("a", 1)], cap_bytes=1, first_cap_bytes=1, order=["z"])


def test_bucket_sizes_are_checked_and_none_means_the_default() -> None:
    assert check_bucket_sizes(None, 1) == (25.0, 1.0)
    assert check_bucket_sizes(4, None) == (4.0, 1.0)
    assert check_bucket_sizes(0.5, 1e-9) == (0.5, 1e-9)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="bucket_cap_mb must be a positive, finite"):
            check_bucket_sizes(bad, 1.0)
    with pytest.raises(ValueError, match="first_bucket_mb must be a positive, finite"):
        check_bucket_sizes(25.0, 0.0)
    for bad_type in ("25", True):
        with pytest.raises(TypeError, match="bucket_cap_mb must be a number of megabytes"):
            check_bucket_sizes(bad_type, 1.0)  # type: ignore[arg-type]
    # Each size's message gives its own default as the example.
    with pytest.raises(TypeError, match=r"first_bucket_mb .*the default is 1.0.*str '1'"):
        check_bucket_sizes(25.0, "1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"bucket_cap_mb .*the default is 25.0"):
        check_bucket_sizes("25", 1.0)  # type: ignore[arg-type]


def test_tiny_sizes_round_up_to_one_byte() -> None:
    assert cap_bytes(1e-9) == 1
    assert cap_bytes(1.0) == MB
    plan = plan_buckets([p("a", 2), p("b", 3)], cap_bytes=cap_bytes(1e-9), first_cap_bytes=1)
    assert [b.names for b in plan] == [("b",), ("a",)]


def test_describe_mentions_every_bucket() -> None:
    plan = plan_buckets([p("a", 10), p("b", 10)], cap_bytes=40, first_cap_bytes=40)
    text = plan.describe()
    assert "2 buckets" in text and "[0]" in text and "[1]" in text
