"""Buffer-policy resolution and grouping: pure functions, no processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from bucketddp.buffers.policies import (
    POLICIES,
    BufferGroup,
    BufferRules,
    group_buffers,
    policy_label,
    resolve_policies,
    scan_buffers,
)

F32, F64, I64 = torch.float32, torch.float64, torch.int64
CPU = torch.device("cpu")

# A small model's buffers, in registration order.
BUFFERS = {
    "ema": F32,
    "pos": I64,
    "neg": I64,
    "bn.running_mean": F32,
    "bn.running_var": F32,
    "bn.num_batches_tracked": I64,
    "head.bn.running_mean": F32,
    "head.bn.running_var": F32,
    "head.bn.num_batches_tracked": I64,
}


def custom(buf: torch.Tensor, group: object) -> None:
    return None


# --------------------------------------------------------------------------- precedence


def test_default_is_broadcast_for_every_buffer() -> None:
    assert resolve_policies(BUFFERS) == dict.fromkeys(BUFFERS, "broadcast")


def test_default_policy_applies_where_no_rule_matches() -> None:
    out = resolve_policies(BUFFERS, rules={"pos": "sum", "neg": "sum"}, default="none")
    assert out["pos"] == out["neg"] == "sum"
    assert {out[n] for n in BUFFERS if n not in ("pos", "neg")} == {"none"}


def test_result_keeps_buffer_order() -> None:
    assert list(resolve_policies(BUFFERS, rules={"*": "none"})) == list(BUFFERS)


def test_exact_name_beats_pattern_in_the_same_mapping() -> None:
    # The pattern comes first in the mapping and still loses to the exact name.
    rules = {"*running_mean": "mean", "bn.running_mean": "max"}
    out = resolve_policies(BUFFERS, rules=rules)
    assert out["bn.running_mean"] == "max"
    assert out["head.bn.running_mean"] == "mean"


def test_exact_name_in_module_hook_beats_pattern_in_strategy_argument() -> None:
    out = resolve_policies(BUFFERS, rules={"bn.*": "none"}, module_rules={"bn.running_var": "mean"})
    assert out["bn.running_var"] == "mean"
    assert out["bn.running_mean"] == "none"


def test_strategy_argument_beats_module_hook_for_the_same_key() -> None:
    out = resolve_policies(
        BUFFERS,
        rules={"pos": "sum", "head.*": "none"},
        module_rules={"pos": "max", "head.*": "broadcast", "ema": "mean"},
    )
    assert out["pos"] == "sum"
    assert out["head.bn.running_mean"] == "none"
    assert out["ema"] == "mean"  # keys only the hook names still apply


def test_strategy_pattern_beats_module_hook_pattern() -> None:
    out = resolve_policies(BUFFERS, rules={"*.running_*": "mean"}, module_rules={"bn.*": "none"})
    assert out["bn.running_mean"] == "mean"
    assert out["bn.num_batches_tracked"] == "none"


def test_first_matching_pattern_wins_in_mapping_order() -> None:
    first = resolve_policies(BUFFERS, rules={"head.*": "none", "*running*": "mean"})
    assert first["head.bn.running_mean"] == "none"
    assert first["bn.running_mean"] == "mean"
    swapped = resolve_policies(BUFFERS, rules={"*running*": "mean", "head.*": "none"})
    assert swapped["head.bn.running_mean"] == "mean"
    assert swapped["head.bn.num_batches_tracked"] == "none"


def test_module_default_beats_global_default() -> None:
    defaults = dict.fromkeys(
        ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"), "none"
    )
    out = resolve_policies(BUFFERS, module_defaults=defaults, default="broadcast")
    assert out["bn.running_mean"] == "none"
    assert out["head.bn.running_mean"] == "broadcast"


@pytest.mark.parametrize(
    "source, key",
    [
        ("rules", "bn.running_mean"),
        ("rules", "bn.*"),
        ("module_rules", "bn.running_mean"),
        ("module_rules", "*running_mean"),
    ],
)
def test_module_default_loses_to_any_explicit_rule(source: str, key: str) -> None:
    defaults = dict.fromkeys(
        ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"), "none"
    )
    out = resolve_policies(BUFFERS, module_defaults=defaults, **{source: {key: "broadcast"}})
    assert out["bn.running_mean"] == "broadcast"


def test_patterns_are_case_sensitive_fnmatch() -> None:
    out = resolve_policies(BUFFERS, rules={"bn.running_[mv]*": "mean", "?eg": "sum"})
    assert out["bn.running_mean"] == out["bn.running_var"] == "mean"
    assert out["neg"] == "sum"
    with pytest.raises(ValueError, match="'EMA'"):
        resolve_policies(BUFFERS, rules={"EMA": "mean"})


def test_callables_and_every_name_are_accepted() -> None:
    for name in POLICIES:
        resolve_policies({"x": F32}, rules={"x": name})
    assert resolve_policies({"x": F32}, rules={"x": custom})["x"] is custom
    assert resolve_policies({"x": F32}, default=custom)["x"] is custom


def test_mean_is_allowed_on_every_floating_and_complex_dtype() -> None:
    dtypes = {"h": torch.float16, "b": torch.bfloat16, "d": F64, "c": torch.complex64}
    assert set(resolve_policies(dtypes, default="mean").values()) == {"mean"}


# ------------------------------------------------------------------------------- errors


def test_unknown_policy_name_names_it_and_the_key() -> None:
    with pytest.raises(
        ValueError, match=r"unknown buffer policy 'average' for 'ema' in buffer_sync"
    ):
        resolve_policies(BUFFERS, rules={"ema": "average"})
    with pytest.raises(ValueError, match=r"'avg' for 'bn\.\*' in configure_buffer_sync"):
        resolve_policies(BUFFERS, module_rules={"bn.*": "avg"})
    with pytest.raises(ValueError, match="default_buffer_policy"):
        resolve_policies(BUFFERS, default="bcast")
    with pytest.raises(
        ValueError, match=r"'bn.running_mean' \(its module's default_buffer_policy\)"
    ):
        resolve_policies(BUFFERS, module_defaults={"bn.running_mean": "nope"})


def test_key_matching_no_buffer_names_the_key_and_lists_buffers() -> None:
    with pytest.raises(ValueError, match=r"buffer_sync key 'encoder\.\*' matches no buffer") as e:
        resolve_policies(BUFFERS, rules={"encoder.*": "mean"})
    assert "bn.running_mean" in str(e.value)
    with pytest.raises(ValueError, match=r"configure_buffer_sync key 'emma' matches no buffer"):
        resolve_policies(BUFFERS, module_rules={"emma": "mean"})
    with pytest.raises(ValueError, match="the module has no buffers"):
        resolve_policies({}, rules={"x": "sum"})


def test_mean_on_integer_buffer_names_the_buffer() -> None:
    with pytest.raises(ValueError, match=r"'pos' has dtype torch\.int64, which cannot hold a mean"):
        resolve_policies(BUFFERS, rules={"pos": "mean"})
    # Through a pattern or the default, the first integer buffer it reaches is named.
    with pytest.raises(ValueError, match=r"'bn\.num_batches_tracked'"):
        resolve_policies(BUFFERS, rules={"bn.*": "mean"})
    with pytest.raises(ValueError, match=r"'pos'.*cannot hold a mean"):
        resolve_policies(BUFFERS, default="mean")
    with pytest.raises(ValueError, match="'flag'"):
        resolve_policies({"flag": torch.bool}, default="mean")


def test_other_impossible_dtype_policies() -> None:
    with pytest.raises(ValueError, match=r"'flag'.*cannot be summed"):
        resolve_policies({"flag": torch.bool}, rules={"flag": "sum"})
    with pytest.raises(ValueError, match=r"'z'.*has no order.*e\.g\. \{'z': 'mean'\}"):
        resolve_policies({"z": torch.complex64}, rules={"z": "max"})
    # The suggested rule works (before, the message suggested the failing 'max' again).
    assert resolve_policies({"z": torch.complex64}, rules={"z": "mean"}) == {"z": "mean"}
    with pytest.raises(ValueError, match=r"e\.g\. \{'flag': 'max'\}"):
        resolve_policies({"flag": torch.bool}, rules={"flag": "sum"})
    # bool works with max/min (any/all); integers with everything but mean.
    assert resolve_policies({"flag": torch.bool}, default="max") == {"flag": "max"}
    for name in ("broadcast", "sum", "max", "min", "none"):
        resolve_policies({"n": I64}, default=name)


@pytest.mark.parametrize("bad", [3, None, ["mean"], {"policy": "mean"}])
def test_policy_that_is_neither_name_nor_callable_names_the_key(bad: object) -> None:
    with pytest.raises(TypeError, match=r"'ema' in buffer_sync has type \w+: it is neither"):
        resolve_policies(BUFFERS, rules={"ema": bad})  # type: ignore[dict-item]


def test_non_string_key_is_refused() -> None:
    with pytest.raises(TypeError, match="not a string"):
        resolve_policies(BUFFERS, rules={0: "mean"})  # type: ignore[dict-item]


def test_a_later_rule_cannot_hide_an_error_in_a_shadowed_one() -> None:
    # Every key is checked, even one whose buffers a higher rule claims.
    with pytest.raises(ValueError, match="'bogus'"):
        resolve_policies(BUFFERS, rules={"ema": "mean"}, module_rules={"ema": "bogus"})


# ----------------------------------------------------------------------------- grouping


def test_groups_by_policy_and_dtype_in_first_appearance_order() -> None:
    resolved = {
        "a": "mean",
        "b": "sum",
        "c": "mean",
        "d": "mean",
        "e": "sum",
        "f": "none",
        "g": "broadcast",
    }
    places = {
        "a": (F32, CPU),
        "b": (I64, CPU),
        "c": (F64, CPU),
        "d": (F32, CPU),
        "e": (I64, CPU),
        "f": (F32, CPU),
        "g": (F32, CPU),
    }
    groups = group_buffers(resolved, places)
    assert groups == [
        BufferGroup("mean", F32, CPU, ("a", "d")),
        BufferGroup("sum", I64, CPU, ("b", "e")),
        BufferGroup("mean", F64, CPU, ("c",)),
        BufferGroup("broadcast", None, CPU, ("g",)),
    ]


def test_none_buffers_form_no_group_and_custom_ones_stay_single() -> None:
    resolved = {"a": custom, "b": custom, "c": "none", "d": "max"}
    places = dict.fromkeys(resolved, (F32, CPU))
    groups = group_buffers(resolved, places)
    assert groups == [
        BufferGroup("max", F32, CPU, ("d",)),
        BufferGroup(custom, F32, CPU, ("a",)),
        BufferGroup(custom, F32, CPU, ("b",)),
    ]


def test_issue_example_six_mean_two_sum_three_none_is_two_groups() -> None:
    resolved = {
        **{f"f{i}": "mean" for i in range(6)},
        **{f"c{i}": "sum" for i in range(2)},
        **{f"r{i}": "none" for i in range(3)},
    }
    places = {n: ((I64 if n.startswith("c") else F32), CPU) for n in resolved}
    groups = group_buffers(resolved, places)
    assert [(g.policy, g.dtype, len(g.names)) for g in groups] == [
        ("mean", F32, 6),
        ("sum", I64, 2),
    ]


def test_policy_label() -> None:
    assert policy_label("mean") == "mean"
    assert policy_label(custom) == f"{__name__}.custom"


def test_broadcast_groups_span_dtypes() -> None:
    resolved = {"f": "broadcast", "i": "broadcast", "d": "broadcast", "m": "max"}
    places = {"f": (F32, CPU), "i": (I64, CPU), "d": (F64, CPU), "m": (I64, CPU)}
    assert group_buffers(resolved, places) == [
        BufferGroup("broadcast", None, CPU, ("f", "i", "d")),
        BufferGroup("max", I64, CPU, ("m",)),
    ]


# ------------------------------------------------- a module's rules, before and after wrapping


class Stats(nn.Module):
    default_buffer_policy = "none"  # statistics kept in agreement by the module itself

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(2))


class Net(nn.Module):
    def __init__(self, hook_rules: object = None) -> None:
        super().__init__()
        self.stats = Stats()
        self.register_buffer("ema", torch.zeros(3))
        self.register_buffer("steps", torch.zeros((), dtype=I64))
        self.register_buffer("later", None)
        self._hook_rules = hook_rules

    def configure_buffer_sync(self) -> object:
        return self._hook_rules


def _rules(net: nn.Module, **kwargs: Any) -> BufferRules:
    given: dict[str, Any] = {"rules": None, "default": "broadcast", "ignored": ()}
    given["default_is_rank_local"] = True
    return BufferRules.read(net, **{**given, **kwargs})


def test_scan_finds_buffers_placeholders_and_module_defaults() -> None:
    found = scan_buffers(Net(), ignored={"steps"})
    assert list(found.owners) == ["ema", "stats.running"]
    assert found.placeholders == ["later"]
    assert found.module_defaults == {"stats.running": "none"}


def test_rules_read_the_module_hook_and_refuse_bad_ones() -> None:
    rules = _rules(Net({"ema": "mean"}), rules={"steps": "sum"})
    assert rules.resolve(scan_buffers(Net(), ())) == {
        "ema": "mean",
        "steps": "sum",
        "stats.running": "none",
    }
    with pytest.raises(TypeError, match=r"configure_buffer_sync\(\) returned a list"):
        _rules(Net(["ema"]))
    with pytest.raises(ValueError, match="_ddp_params_and_buffers_to_ignore lists it"):
        _rules(Net({"ema": "mean"}), ignored={"ema"})


def test_buffers_after_wrapping_keep_or_get_their_policies() -> None:
    net = Net({"ema": "mean", "later": "max"})
    rules = _rules(net)
    known = rules.resolve(scan_buffers(net, ()))
    del net.ema
    net.later = torch.zeros(4)
    again = rules.resolve_again(scan_buffers(net, ()), {**known, "steps": "sum"})
    # "ema" is gone, though a rule names it; "later" follows its rule; "steps" keeps its own.
    assert again == {"steps": "sum", "later": "max", "stats.running": "none"}


def test_rank_local_buffers_are_the_none_of_a_rule_or_the_default() -> None:
    net = Net({"steps": "none"})
    found = scan_buffers(net, ())
    by_rule = _rules(net)
    assert by_rule.rank_local(by_rule.resolve(found), found.module_defaults) == {"steps"}
    by_default = _rules(net, default="none")
    policies = by_default.resolve(found)
    assert by_default.rank_local(policies, found.module_defaults) == {"ema", "steps"}
    forward_sync_off = _rules(net, default="none", default_is_rank_local=False)
    assert forward_sync_off.rank_local(policies, found.module_defaults) == {"steps"}
