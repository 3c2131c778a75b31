"""Buffer policies at wrapping time, on real gloo process groups.

Bad rules raise on every rank and name the buffer, the rule and where it came from; good
rules combine from the wrapper's argument, the module's configure_buffer_sync hook and
submodules' defaults; and every buffer but the explicitly rank-local ones starts from
rank 0's value.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from bucketddp import BucketDataParallel
from bucketddp.buffers import policy_label
from multirank import run_ranks

TIMEOUT = 60.0


# ----------------------------------------------------------------- errors at setup


class Configured(nn.Module):
    """Declares its own rules, as a LightningModule's configure_buffer_sync does."""

    def __init__(self, hook_rules: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.hook_rules = hook_rules or {}
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("pos", torch.zeros((), dtype=torch.long))
        self.register_buffer("seed", torch.zeros((), dtype=torch.long))
        self.norm = LocalStats()
        self.other = LocalStats()

    def configure_buffer_sync(self) -> dict[str, Any]:
        return self.hook_rules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class LocalStats(nn.Module):
    """Stands in for SyncBatchNorm: its statistics are already global."""

    default_buffer_policy = "none"

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(4))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))


def _try(**kwargs: Any) -> tuple[str, str] | None:
    hook_rules = kwargs.pop("hook_rules", None)
    try:
        BucketDataParallel(Configured(hook_rules), **kwargs)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def _error_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "unknown": _try(buffer_sync={"ema": "average"}),
        "unknown_in_hook": _try(hook_rules={"norm.*": "avg"}),
        "no_match_pattern": _try(buffer_sync={"encoder.*": "mean"}),
        "no_match_name": _try(hook_rules={"emma": "mean"}),
        "mean_on_int": _try(buffer_sync={"pos": "mean"}),
        "mean_on_int_default": _try(default_buffer_policy="mean"),
        "not_callable": _try(buffer_sync={"ema": 3}),
        "not_a_mapping": _try(buffer_sync="mean"),
        "hook_not_a_mapping": _try(hook_rules=["ema"]),
        "rank_differs": _try(buffer_sync={"ema": "mean" if rank == 0 else "max"}),
        "one_rank_fails": _try(buffer_sync={"ema": "mean"} if rank == 0 else {"emma": "mean"}),
    }
    # After all that, the ranks are still in step: a good setup and a sync work.
    ddp = BucketDataParallel(Configured({"ema": "mean"}), buffer_sync={"pos": "sum"})
    out["after"] = ddp.sync_buffers()
    return out


@pytest.fixture(scope="module")
def errors() -> list[dict[str, Any]]:
    return run_ranks(_error_worker, 2, timeout=TIMEOUT)


@pytest.mark.parametrize(
    "case, kind, words",
    [
        ("unknown", "ValueError", ["'average'", "'ema'", "buffer_sync"]),
        ("unknown_in_hook", "ValueError", ["'avg'", "'norm.*'", "configure_buffer_sync"]),
        ("no_match_pattern", "ValueError", ["'encoder.*'", "matches no buffer"]),
        ("no_match_name", "ValueError", ["'emma'", "matches no buffer", "configure_buffer_sync"]),
        ("mean_on_int", "ValueError", ["'pos'", "torch.int64", "mean"]),
        ("mean_on_int_default", "ValueError", ["'pos'", "mean"]),
        ("not_callable", "TypeError", ["'ema'", "int", "callable"]),
        ("not_a_mapping", "TypeError", ["buffer_sync is a str ('mean')", "use a dict"]),
        ("hook_not_a_mapping", "TypeError", ["configure_buffer_sync() returned a list"]),
        ("rank_differs", "RuntimeError", ["different buffer policies", "'ema'", "rank 1"]),
    ],
)
def test_setup_error_on_every_rank_names_the_culprit(
    errors: list[dict[str, Any]], case: str, kind: str, words: list[str]
) -> None:
    for rank, result in enumerate(errors):
        assert result[case] is not None, f"rank {rank} raised nothing for {case}"
        got_kind, message = result[case]
        assert got_kind == kind, message
        for word in words:
            assert word in message, f"rank {rank}: {word!r} not in {message!r}"


def test_an_error_on_one_rank_is_raised_on_all(errors: list[dict[str, Any]]) -> None:
    kind0, message0 = errors[0]["one_rank_fails"]
    kind1, message1 = errors[1]["one_rank_fails"]
    assert kind0 == kind1 == "ValueError"
    assert "on rank 1" in message0 and "'emma'" in message0
    assert "'emma'" in message1


def test_ranks_stay_in_step_after_setup_errors(errors: list[dict[str, Any]]) -> None:
    # ema (float mean), pos (long sum), seed (long broadcast); norm.* and other.* are none.
    assert [r["after"] for r in errors] == [3, 3]


# -------------------------------------------- configuration sources, "none" at setup


def _config_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = Configured({"ema": "mean", "pos": "max", "seed": "none", "other.*": "broadcast"})
    with torch.no_grad():  # per-rank values set before wrapping
        for buf in model.buffers():
            buf.fill_(rank + 1)
    ddp = BucketDataParallel(model, buffer_sync={"pos": "sum"})
    out["policies"] = {n: policy_label(p) for n, p in ddp.buffers_sync.policies.items()}
    out["after_wrap"] = {n: b.clone() for n, b in model.named_buffers()}
    from_rank0 = {id(b) for b in ddp.buffers_sync.buffers_from_rank0()}
    out["from_rank0"] = [n for n, b in model.named_buffers() if id(b) in from_rank0]
    out["rank_local"] = ddp.buffers_sync.rank_local
    return out


@pytest.fixture(scope="module")
def config() -> list[dict[str, Any]]:
    return run_ranks(_config_worker, 2, timeout=TIMEOUT)


def test_module_hook_wrapper_argument_and_module_defaults_combine(
    config: list[dict[str, Any]],
) -> None:
    assert config[0]["policies"] == {
        "ema": "mean",  # the module's hook
        "pos": "sum",  # the wrapper's argument beats the hook's "max"
        "seed": "none",
        "norm.running": "none",  # the submodule's own default
        "norm.seen": "none",
        "other.running": "broadcast",  # the hook's pattern beats the submodule's default
        "other.seen": "broadcast",
    }


def test_only_explicit_none_buffers_are_rank_local(config: list[dict[str, Any]]) -> None:
    for r in config:
        assert r["rank_local"] == {"seed"}
        assert "seed" not in r["from_rank0"]
        assert len(r["from_rank0"]) == len(r["policies"]) - 1


def test_buffers_start_from_rank_0(config: list[dict[str, Any]]) -> None:
    # A module's own "none" (SyncBatchNorm's) still starts from rank 0's value.
    for name in ("ema", "pos", "norm.running", "norm.seen", "other.running", "other.seen"):
        assert [int(r["after_wrap"][name].flatten()[0]) for r in config] == [1, 1], name


def test_rank_local_buffers_keep_their_value_through_wrapping(
    config: list[dict[str, Any]],
) -> None:
    assert [int(r["after_wrap"]["seed"]) for r in config] == [1, 2]
