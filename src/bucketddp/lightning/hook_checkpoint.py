"""A communication hook's state in Trainer checkpoints (``ckpt_path``), for every rank.

``checkpoint["bucketddp_comm_hook"]`` holds the hook state's shared part and each rank's own
part (``bucketddp.hook_state``): PowerSGD's error feedback differs per rank, and rank 0
writes the file, so saving gathers the parts to rank 0. That gather is a collective; it is
made only when a stateful hook is registered, and ``trainer.save_checkpoint`` runs on every
rank anyway. On resume each rank takes its own part back at an unchanged world size; at
another one the per-rank part starts afresh with a warning. The parts go back at the first
training step, once the wrapper holds the hook.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import hook_state

KEY = "bucketddp_comm_hook"


def _moved(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in its dicts, lists and tuples on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, device) for v in value)
    return value


class HookCheckpoint:
    """Saves the hook's state into checkpoints and puts a loaded one back."""

    def __init__(self, comm_hook: tuple[Any, Any] | None) -> None:
        self._state = comm_hook[0] if comm_hook is not None else None
        self._loaded: dict[str, Any] | None = None

    def save(self, checkpoint: dict[str, Any]) -> None:
        """Add the hook's state to ``checkpoint`` (every rank calls this; rank 0 writes)."""
        shared, own = hook_state.capture(self._state)
        if (shared is None and own is None) or not dist.is_initialized():
            return
        owns: list[Any] | None = None
        if own is not None:
            owns = [None] * dist.get_world_size()
            mine = _moved(own, torch.device("cpu"))
            dist.all_gather_object(owns, mine)
        checkpoint[KEY] = {"shared": shared, "world_size": dist.get_world_size(), "owns": owns}

    def loaded(self, checkpoint: dict[str, Any]) -> None:
        """Keep the loaded checkpoint's hook state for the first training step."""
        self._loaded = checkpoint.get(KEY)

    def restore(self, device: torch.device) -> None:
        """Put the kept hook state back (once), its tensors on ``device``."""
        entry, self._loaded = self._loaded, None
        if entry is None or self._state is None:
            return
        owns = entry["owns"]
        own = None
        if owns is not None and entry["world_size"] == dist.get_world_size():
            own = _moved(owns[dist.get_rank()], device)
        hook_state.restore(self._state, entry["shared"], own, had_own=owns is not None)
