"""Resume with no shared filesystem: rank 0 reads a checkpoint and sends it to the others.

``load_checkpoint(path)`` is one collective call. Every rank checks whether it sees
``path``; if some rank does not, rank 0 reads the file and ``broadcast_checkpoint`` sends
its contents, so the other ranks never open it. The contents travel in two parts:

- a *skeleton*: the checkpoint pickled with every dense tensor replaced by its index
  (``skeleton.py``), so any nesting of dicts, lists and objects comes through; it is small,
  and goes in one ``broadcast_object_list``;
- the tensors' bytes, as one stream cut into pieces of at most ``chunk_mb``. A piece inside
  one tensor is broadcast straight into (or out of) that tensor; pieces that span several
  tensors, or need a device (NCCL), go through one staging buffer of at most ``chunk_mb``.

So a receiving rank holds the checkpoint once, plus one piece: never a pickled blob of the
whole state. The Lightning strategies call this from their ``load_checkpoint``. Nothing here
imports Lightning.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist

from .comm import global_rank
from .skeleton import as_bytes, join_tensors, split_tensors

__all__ = [
    "broadcast_checkpoint",
    "check_source",
    "load_checkpoint",
    "plan_pieces",
    "strip_prefix",
]

DEFAULT_CHUNK_MB = 32.0
"""The largest piece of tensor data one broadcast carries, and the staging buffer's size."""

Source = Literal["auto", "rank0", "local"]
"""Who reads: ``"auto"`` (rank 0 sends when some rank lacks the file, else each reads),
``"rank0"`` (rank 0 always reads and sends) or ``"local"`` (each rank reads its own)."""

SOURCES = ("auto", "rank0", "local")


Piece = list[tuple[int, int, int]]
"""One broadcast: ``(tensor index, first byte, end byte)`` for each tensor it covers."""


def plan_pieces(nbytes: list[int], cap: int) -> list[Piece]:
    """Cut the tensors' bytes, laid end to end, into pieces of at most ``cap`` bytes.

    Pure: every rank plans the same pieces from the same sizes. A tensor larger than
    ``cap`` spans several pieces; small ones share a piece. Empty tensors get none.
    """
    if cap < 1:
        raise ValueError(f"the piece size must be at least one byte, got {cap}")
    pieces: list[Piece] = []
    current: Piece = []
    room = cap
    for index, size in enumerate(nbytes):
        start = 0
        while start < size:
            take = min(size - start, room)
            current.append((index, start, start + take))
            start += take
            room -= take
            if room == 0:
                pieces.append(current)
                current, room = [], cap
    if current:
        pieces.append(current)
    return pieces


def strip_prefix(
    state_dict: Mapping[str, Any],
    prefix: str = "module.",
    *,
    model_keys: Iterable[str] | None = None,
) -> Mapping[str, Any]:
    """``state_dict`` without ``prefix`` on its keys, when every key carries it: a state
    dict saved from a torch DDP or ``BucketDataParallel`` wrapper. Else (or when every key
    of the model it is for, ``model_keys``, carries the prefix too) ``state_dict`` itself."""
    if not state_dict or not all(k.startswith(prefix) for k in state_dict):
        return state_dict
    if model_keys is not None and all(k.startswith(prefix) for k in model_keys):
        return state_dict
    return OrderedDict((k[len(prefix) :], v) for k, v in state_dict.items())


def check_source(source: object) -> Source:
    """``source`` if it names who reads a checkpoint (``SOURCES``).

    Raises:
        ValueError: any other value, naming the choices.
    """
    if source not in SOURCES:
        raise ValueError(f"checkpoint source must be one of {SOURCES}, got {source!r}")
    return source  # type: ignore[return-value]


# ------------------------------------------------------------------------------ loading
def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    source: Source = "auto",
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    weights_only: bool | None = None,
    read: Callable[[Any], Any] | None = None,
    exists: Callable[[Any], bool] | None = None,
    chunk_mb: float = DEFAULT_CHUNK_MB,
) -> Any:
    """Load ``path`` on every rank of ``group``, even if only rank 0 can see it.

    A collective: every rank calls it. With ``source="auto"`` each rank checks that it sees
    ``path`` (relative paths are taken from each rank's working directory); if every rank
    does, each reads its own copy, as a plain ``torch.load`` would; if some rank does not,
    rank 0 reads the file and sends the contents to all others, which never open it.
    ``"rank0"`` always sends from rank 0 (one read of a shared filesystem, and no stale
    copy on another node can win); ``"local"`` never sends, and raises on every rank if
    one lacks the file. Without a process group (or at world size 1) it is a plain read.

    Args:
        path: the checkpoint; rank 0 must see it.
        source: ``"auto"``, ``"rank0"`` or ``"local"``, as above.
        group: the ranks that load (default: all); its rank 0 reads.
        device: where the reading rank maps tensors (``torch.load``'s ``map_location``)
            and where the receiving ranks put them.
        weights_only: passed to ``torch.load`` (``None``: torch's default).
        read: how a rank reads the file, ``read(path) -> object`` (default: ``torch.load``
            with ``device`` and ``weights_only``).
        exists: how a rank checks for the file (default: ``os.path.exists``).
        chunk_mb: the largest piece of tensor data one broadcast carries.

    Returns:
        The checkpoint, on every rank.

    Raises:
        FileNotFoundError: on every rank, when rank 0 does not see ``path`` (or, with
            ``"local"``, some rank does not).
        RuntimeError: on the other ranks, when rank 0 (or any rank reading its own copy)
            failed to read the file; the reading rank raises its own error.
        ValueError: an unknown ``source``.
    """
    check_source(source)
    if read is None:
        read = lambda p: torch.load(p, map_location=device, weights_only=weights_only)  # noqa: E731
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return read(path)
    seen = bool((exists or os.path.exists)(path))
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, (seen, os.path.abspath(path)), group=group)
    missing = [rank for rank, (has, _) in enumerate(found) if not has]
    if 0 in missing or (source == "local" and missing):
        raise FileNotFoundError(_not_found(path, found, missing, source))
    if source == "local" or (source == "auto" and not missing):
        return _read_everywhere(read, path, group)
    loaded = _read_on_rank0(read, path, group)
    return broadcast_checkpoint(loaded, group=group, device=device, chunk_mb=chunk_mb)


def _not_found(path: Any, found: list[Any], missing: list[int], source: str) -> str:
    where = "; ".join(f"rank {r}: {p}" for r, (_, p) in enumerate(found) if r in missing)
    if 0 in missing:
        return (
            f"bucketddp: checkpoint {str(path)!r} not found on rank 0, which reads it and "
            f"sends it to the other ranks (looked for {where}). Pass a path that exists on "
            "rank 0's node; a relative path is taken from each rank's working directory."
        )
    return (
        f"bucketddp: checkpoint {str(path)!r} not found on ranks {missing} (looked for "
        f"{where}), and source={source!r} has every rank read its own copy. Pass "
        "source='auto' to have rank 0 send it."
    )


def _read_everywhere(read: Callable[[Any], Any], path: Any, group: Any) -> Any:
    """Each rank reads its own copy; a rank whose read fails stops every rank."""
    loaded, error = _try(read, path)
    messages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, _message(error), group=group)
    if error is not None:
        raise error
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if failed:
        rank, message = failed[0]
        raise RuntimeError(f"bucketddp: rank {rank} could not read checkpoint {path!r}: {message}")
    return loaded


def _read_on_rank0(read: Callable[[Any], Any], path: Any, group: Any) -> Any:
    """Rank 0 reads; the others learn whether it could, so none waits on a failed read."""
    loaded, error = _try(read, path) if dist.get_rank(group) == 0 else (None, None)
    status: list[Any] = [_message(error)]
    dist.broadcast_object_list(status, src=global_rank(group), group=group)
    if error is not None:
        raise error
    if status[0] is not None:
        raise RuntimeError(f"bucketddp: rank 0 could not read checkpoint {path!r}: {status[0]}")
    return loaded


def _try(read: Callable[[Any], Any], path: Any) -> tuple[Any, Exception | None]:
    try:
        return read(path), None
    except Exception as err:  # told to every rank, then raised here
        return None, err


def _message(error: Exception | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


# ---------------------------------------------------------------------------- transport
def broadcast_checkpoint(
    checkpoint: Any,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    chunk_mb: float = DEFAULT_CHUNK_MB,
    src: int = 0,
) -> Any:
    """Send rank ``src``'s ``checkpoint`` (any picklable object holding tensors) to every rank.

    A collective: rank ``src`` (of ``group``) passes the object and gets it back unchanged;
    the other ranks pass anything (it is ignored) and get a copy, with its tensors on
    ``device``. Dense tensors travel as bytes in pieces of at most ``chunk_mb`` MB (see the
    module docstring); other tensors (sparse, quantized, subclasses) are pickled inside the
    skeleton. Tensors that shared storage on the sender share it on every rank;
    ``nn.Parameter`` stays a Parameter.
    """
    cap = max(1, int(chunk_mb * 2**20))
    comm = _comm_device(group)
    sending = dist.get_rank(group) == src
    sender = global_rank(group, src)
    tensors: list[torch.Tensor] = []
    header: list[Any] = [None]
    if sending:
        skeleton, tensors, metas = split_tensors(checkpoint)
        header = [(skeleton, metas)]
    dist.broadcast_object_list(header, src=sender, group=group, device=comm)
    skeleton, metas = header[0]
    if not sending:
        tensors = [torch.empty(m.shape, dtype=m.dtype, device=device) for m in metas]
    _send_bytes(tensors, [m.nbytes for m in metas], cap, comm, sending, group, sender)
    if sending:
        return checkpoint
    return join_tensors(skeleton, tensors, metas)


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _send_bytes(
    tensors: list[torch.Tensor],
    nbytes: list[int],
    cap: int,
    comm: torch.device,
    sending: bool,
    group: dist.ProcessGroup | None,
    src: int,
) -> None:
    """Broadcast every tensor's bytes from global rank ``src``, piece by piece (see
    ``plan_pieces``)."""
    staging: torch.Tensor | None = None
    view: tuple[int, torch.Tensor] | None = None  # the byte view of the tensor at hand
    for piece in plan_pieces(nbytes, cap):
        parts = []
        for index, start, end in piece:
            if view is None or view[0] != index:
                view = (index, as_bytes(tensors[index]))
            parts.append(view[1][start:end])
        if len(parts) == 1 and parts[0].device == comm:
            dist.broadcast(parts[0], src=src, group=group)  # straight into/out of the tensor
            continue
        if staging is None:
            staging = torch.empty(min(cap, sum(nbytes)), dtype=torch.uint8, device=comm)
        flat = staging[: sum(p.numel() for p in parts)]
        offsets = [0]
        for p in parts:
            offsets.append(offsets[-1] + p.numel())
        if sending:
            for p, a, b in zip(parts, offsets, offsets[1:], strict=False):
                flat[a:b].copy_(p)
        dist.broadcast(flat, src=src, group=group)
        if not sending:
            for p, a, b in zip(parts, offsets, offsets[1:], strict=False):
                p.copy_(flat[a:b])
