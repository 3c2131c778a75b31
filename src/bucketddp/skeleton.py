"""An object taken apart into a *skeleton* and its tensors, and put back together.

The skeleton is the object pickled with every dense tensor replaced by its index in a list,
so any nesting of dicts, lists and objects comes through, and the tensors' bytes can travel
or be stored on their own (``checkpoint.py`` broadcasts them; the elastic snapshots copy
them into shared memory). Views of one storage with the same geometry (tied weights) are
one tensor. A Parameter comes back as a Parameter.

The pickler asks about a tensor only through ``reducer_override``, which pickle calls for
objects of types it does not know (not for the dicts, strings and numbers that make up most
of a state dict), and each tensor's meta is read in the same call: taking apart a state of
600 tensors costs a few milliseconds of Python, once per snapshot.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, NamedTuple

import torch

_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter
_STRIDED = torch.strided


class TensorMeta(NamedTuple):
    """What a receiving rank needs to allocate one tensor before its bytes arrive (a named
    tuple: made once per tensor per snapshot, it must be cheap)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    parameter: bool
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.dtype.itemsize


def _tensor_at(index: int) -> torch.Tensor:
    """Stands for tensor ``index`` in a skeleton; only ``_Unpickler`` resolves it."""
    raise pickle.UnpicklingError(f"a skeleton's tensor {index} read without its tensors")


class _Pickler(pickle.Pickler):
    """Pickles an object with each dense tensor replaced by its index in ``tensors``."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.metas: list[TensorMeta] = []
        self.index: dict[tuple[Any, ...], int] = {}

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if (
            (kind is not _TENSOR and kind is not _PARAMETER)
            or obj.layout != _STRIDED
            or obj.is_quantized
            or obj.is_meta
        ):
            return NotImplemented
        shape = obj.shape
        # Views of one storage with the same geometry (tied weights) travel once.
        key = (
            (obj.data_ptr(), shape, obj.stride(), obj.dtype, obj.device)
            if obj.numel()
            else (id(obj),)
        )
        index = self.index.get(key)
        if index is None:
            index = self.index[key] = len(self.tensors)
            self.tensors.append(obj)
            parameter = kind is _PARAMETER or bool(getattr(obj, "_is_param", False))
            self.metas.append(TensorMeta(obj.dtype, tuple(shape), parameter, obj.requires_grad))
        return _tensor_at, (index,)


class _Unpickler(pickle.Unpickler):
    def __init__(
        self, file: io.BytesIO, tensors: list[torch.Tensor], metas: list[TensorMeta]
    ) -> None:
        super().__init__(file)
        self.tensors = tensors
        self.made: dict[int, torch.Tensor] = {}
        self.metas = metas

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == _tensor_at.__name__:
            return self._tensor
        return super().find_class(module, name)

    def _tensor(self, index: int) -> torch.Tensor:
        if index not in self.made:
            t, meta = self.tensors[index], self.metas[index]
            self.made[index] = torch.nn.Parameter(t, meta.requires_grad) if meta.parameter else t
        return self.made[index]


def split_tensors(obj: Any) -> tuple[bytes, list[torch.Tensor], list[TensorMeta]]:
    """``obj`` pickled with each dense tensor replaced by its index (the skeleton), the
    tensors in index order, and what it takes to allocate each."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.tensors, pickler.metas


def join_tensors(skeleton: bytes, tensors: list[torch.Tensor], metas: list[TensorMeta]) -> Any:
    """The object ``split_tensors`` took apart, its tensors taken from ``tensors``."""
    for t, m in zip(tensors, metas, strict=True):
        t.requires_grad_(m.requires_grad and not m.parameter)
    return _Unpickler(io.BytesIO(skeleton), tensors, metas).load()


def to_bytes(obj: Any) -> bytes:
    """``obj`` as bytes, its dense tensors' data raw (``from_bytes`` reads it back, each
    tensor on its device): several times cheaper than ``torch.save`` for a small object."""
    skeleton, tensors, metas = split_tensors(obj)
    devices = [str(t.device) for t in tensors]
    blobs = [as_bytes(t).cpu().numpy().tobytes() for t in tensors]
    return pickle.dumps((skeleton, metas, devices, blobs), protocol=pickle.HIGHEST_PROTOCOL)


def from_bytes(data: bytes) -> Any:
    """The object ``to_bytes`` wrote. Unpickles: only for bytes this process trusts."""
    skeleton, metas, devices, blobs = pickle.loads(data)
    tensors = [
        _tensor_from(blob, meta).to(device)
        for blob, meta, device in zip(blobs, metas, devices, strict=True)
    ]
    return join_tensors(skeleton, tensors, metas)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t``'s data (of a contiguous copy, if ``t`` is not)."""
    t = t.detach().resolve_conj().resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8)


def _tensor_from(blob: bytes, meta: TensorMeta) -> torch.Tensor:
    if not blob:
        return torch.empty(meta.shape, dtype=meta.dtype)
    raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return raw.view(meta.dtype).reshape(meta.shape)
