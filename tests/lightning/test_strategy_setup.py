"""BucketDDP under Lightning, in the test process: every DDP name has its bucket twin, the
options pass through or fail early, the SyncBatchNorm plugin, and the import order of
bucketddp and Lightning (in fresh interpreters)."""

import sys
import textwrap
import warnings
from typing import Any

import pytest
import torch

from lightning_runs import run_script

lightning = pytest.importorskip("lightning")

# Lightning's DDP names, each with the start method and find_unused_parameters it means.
TRAINER_DDP_NAMES = {
    f"{start}{suffix}": (method, unused)
    for start, method in [
        ("ddp", "popen"),
        ("ddp_spawn", "spawn"),
        ("ddp_fork", "fork"),
        ("ddp_notebook", "fork"),
    ]
    for suffix, unused in [
        ("", False),
        ("_find_unused_parameters_true", True),
        ("_find_unused_parameters_false", False),
    ]
}
FABRIC_DDP_NAMES = {
    name: TRAINER_DDP_NAMES[name]
    for name in ["ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true"]
}


def test_every_ddp_name_has_a_twin_with_its_meaning() -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy as TrainerDDP
    from lightning.pytorch.strategies import StrategyRegistry

    from bucketddp import BucketDDP, BucketFabricDDP

    # The tables above are Lightning's own lists of DDP names, and what they mean.
    assert {n for n in StrategyRegistry if StrategyRegistry[n]["strategy"] is TrainerDDP} == set(
        TRAINER_DDP_NAMES
    )
    assert {n for n in STRATEGY_REGISTRY if STRATEGY_REGISTRY[n]["strategy"] is DDPStrategy} == (
        set(FABRIC_DDP_NAMES)
    )
    for name, (start_method, unused) in TRAINER_DDP_NAMES.items():
        for twin, built in [(name, TrainerDDP), (f"bucket_{name}", BucketDDP)]:
            strategy = Trainer(strategy=twin, accelerator="cpu", devices=2, logger=False).strategy
            assert type(strategy) is built, twin
            assert strategy._start_method == start_method, twin
            assert strategy._ddp_kwargs.get("find_unused_parameters", False) is unused, twin
    for name, (start_method, unused) in FABRIC_DDP_NAMES.items():
        for twin, built in [(name, DDPStrategy), (f"bucket_{name}", BucketFabricDDP)]:
            strategy = Fabric(strategy=twin, accelerator="cpu", devices=2).strategy
            assert type(strategy) is built, twin
            assert strategy._start_method == start_method, twin
            assert strategy._ddp_kwargs.get("find_unused_parameters", False) is unused, twin
    bucket = Fabric(strategy="bucket_ddp_find_unused_parameters_true", devices=2).strategy
    assert bucket.engine_options.find_unused_parameters is True


def test_options_pass_through_and_bad_ones_fail_early() -> None:
    from datetime import timedelta

    from bucketddp import BucketDDP

    s = BucketDDP(
        bucket_cap_mb=4,
        first_bucket_mb=0.5,
        gradient_as_bucket_view=False,
        buffer_sync={"*.running_*": "mean"},
        default_buffer_policy="none",
        static_graph=True,
        process_group_backend="gloo",
        timeout=timedelta(seconds=30),
    )
    assert s._ddp_kwargs == {
        "bucket_cap_mb": 4,
        "first_bucket_mb": 0.5,
        "find_unused_parameters": False,
        "gradient_as_bucket_view": False,
        "broadcast_buffers": None,
        "buffer_sync": {"*.running_*": "mean"},
        "default_buffer_policy": "none",
        "static_graph": True,
        "init_sync": True,
        "forward_sync_buffers": None,
        "check_finite": False,
        "telemetry": True,
        "watchdog": True,
        "stall_timeout": 600.0,
    }
    assert s.process_group_backend == "gloo"
    assert s._timeout == timedelta(seconds=30)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive, finite number"):
        BucketDDP(bucket_cap_mb=0)
    assert BucketDDP(bucket_cap_mb=None)._ddp_kwargs["bucket_cap_mb"] == 25.0  # torch DDP's
    with pytest.raises(ValueError, match="unknown buffer policy 'avg'"):
        BucketDDP(default_buffer_policy="avg")
    with pytest.raises(TypeError, match="sync_batchnorm must be True or False, got str 'yes'"):
        BucketDDP(sync_batchnorm="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="find_unused_parameters must be True or False"):
        BucketDDP(find_unused_parameters="False")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"buffer_sync is a list \(\['a'\]\); use a dict"):
        BucketDDP(buffer_sync=["a"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="broadcast_buffers=True contradicts forward_sync_"):
        BucketDDP(broadcast_buffers=True, forward_sync_buffers=False)
    with pytest.raises(ValueError, match="forward_sync_buffers=False contradicts default_buf"):
        BucketDDP(forward_sync_buffers=False, default_buffer_policy="mean")
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook

    with pytest.raises(ValueError, match="ddp_comm_wrapper apply to a ddp_comm_hook"):
        BucketDDP(ddp_comm_wrapper=default_hooks.fp16_compress_wrapper)
    local_sgd = post_localSGD_hook.PostLocalSGDState(None, None, start_localSGD_iter=8)
    hook = post_localSGD_hook.post_localSGD_hook
    with pytest.raises(ValueError, match="pass model_averaging_period=N"):
        BucketDDP(ddp_comm_state=local_sgd, ddp_comm_hook=hook)
    with pytest.raises(ValueError, match="applies to post-local SGD only"):
        BucketDDP(model_averaging_period=4)
    with pytest.raises(ValueError, match="must be a positive integer, got 0"):
        BucketDDP(ddp_comm_state=local_sgd, ddp_comm_hook=hook, model_averaging_period=0)
    hooked = BucketDDP(
        ddp_comm_hook=default_hooks.allreduce_hook,
        ddp_comm_wrapper=default_hooks.fp16_compress_wrapper,
    )
    assert hooked._comm_hook is not None and hooked._comm_hook[0] is None


def test_sync_batchnorm_uses_our_layer_sync_plugin() -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins import LayerSync

    from bucketddp import BucketDDP
    from bucketddp.lightning.layer_sync import BucketSyncBatchNorm

    def layer_sync(**kwargs: Any) -> object:
        trainer = Trainer(accelerator="cpu", devices=2, logger=False, **kwargs)
        return trainer.strategy._layer_sync

    assert layer_sync(strategy=BucketDDP()) is None
    assert isinstance(layer_sync(strategy=BucketDDP(sync_batchnorm=True)), BucketSyncBatchNorm)
    # Lightning's TorchSyncBatchNorm, from the Trainer's flag or given explicitly, reaches
    # the strategy alike: it is replaced by ours, with a warning that says why...
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    why = "torch.nn.SyncBatchNorm refuses CPU tensors in training"
    for kwargs in [{"sync_batchnorm": True}, {"plugins": [TorchSyncBatchNorm()]}]:
        with pytest.warns(UserWarning, match=why):
            assert isinstance(layer_sync(strategy=BucketDDP(), **kwargs), BucketSyncBatchNorm)
    # ...unless the strategy was asked for SyncBatchNorm itself.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin = layer_sync(strategy=BucketDDP(sync_batchnorm=True), sync_batchnorm=True)
    assert isinstance(plugin, BucketSyncBatchNorm)

    class Mine(LayerSync):
        def apply(self, model: torch.nn.Module) -> torch.nn.Module:
            return model

        def revert(self, model: torch.nn.Module) -> torch.nn.Module:
            return model

    assert isinstance(layer_sync(strategy=BucketDDP(), plugins=[Mine()]), Mine)


IMPORT_CHECKS = {
    "bucketddp first": """
        import sys, bucketddp
        assert not [m for m in sys.modules if m.startswith("lightning")]
        from lightning.pytorch import Trainer
        from lightning.pytorch.strategies import StrategyRegistry
        assert {"bucket_ddp", "bucket_ddp_spawn",
                "bucket_ddp_find_unused_parameters_true"} <= set(StrategyRegistry)
        assert type(Trainer(strategy="bucket_ddp", logger=False).strategy) is bucketddp.BucketDDP
        from lightning.fabric import Fabric
        fabric = Fabric(strategy="bucket_ddp_notebook", accelerator="cpu", devices=2)
        assert type(fabric.strategy) is bucketddp.BucketFabricDDP
        # The import hook leaves Lightning's own loader in place, and removes itself.
        import lightning.pytorch as lp
        assert "Registering" not in type(lp.__loader__).__name__
        assert not [f for f in sys.meta_path if "Lightning" in type(f).__name__]
    """,
    "lightning first": """
        import lightning
        import bucketddp
        from lightning.pytorch.strategies import StrategyRegistry
        assert "bucket_ddp_spawn" in StrategyRegistry
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        assert "bucket_ddp_fork" in STRATEGY_REGISTRY
    """,
    "bucketddp.lightning.fabric first": """
        import sys
        from bucketddp.lightning.fabric import BucketFabricDDP
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        from lightning.pytorch.strategies import StrategyRegistry
        assert STRATEGY_REGISTRY["bucket_ddp"]["strategy"] is BucketFabricDDP
        assert "bucket_ddp_notebook" in StrategyRegistry
        assert not [f for f in sys.meta_path if "Lightning" in type(f).__name__]
    """,
    "without lightning": """
        import sys
        sys.modules["lightning"] = None  # as if Lightning were not installed
        import torch, bucketddp
        assert bucketddp.BucketDataParallel and bucketddp.convert_sync_batchnorm
        for name in ("BucketDDP", "BucketFabricDDP"):
            try:
                getattr(bucketddp, name)
            except ImportError as err:
                assert "pip install" in str(err), err
            else:
                raise AssertionError(f"{name} without Lightning should raise ImportError")
    """,
}


def test_sync_batchnorm_without_a_batchnorm_layer_warns() -> None:
    import warnings

    from lightning.pytorch.demos.boring_classes import BoringModel

    from bucketddp import BucketDDP

    # What DDPStrategy.setup does with the plugin: ours warns when it finds nothing to convert.
    plugin = BucketDDP(sync_batchnorm=True)._layer_sync
    assert plugin is not None
    with pytest.warns(UserWarning, match=r"sync_batchnorm=True, but the model \(BoringModel\) has"):
        plugin.apply(BoringModel())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin.apply(torch.nn.Sequential(torch.nn.BatchNorm1d(2)))


@pytest.mark.parametrize("order", list(IMPORT_CHECKS))
def test_import_order(order: str) -> None:
    run_script([sys.executable, "-c", textwrap.dedent(IMPORT_CHECKS[order])], timeout=300)
