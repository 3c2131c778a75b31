"""Where the wrapper runs: the device its inputs go to, and the group it reduces over.

torch DDP's ``device_ids``, ``output_device``, ``device_mesh`` and ``process_group``
arguments, checked against the module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def input_device(
    devices: set[torch.device],
    device_ids: Sequence[int | str | torch.device] | None,
    output_device: int | str | torch.device | None,
) -> torch.device | None:
    """The device that ``device_ids`` names for a module on ``devices``, or None.

    torch DDP's rules: only a module on a single accelerator takes ``device_ids``, one
    device per process; ``output_device`` may only repeat it. An integer is an index on the
    module's device type.

    Raises:
        ValueError: naming the arguments, the module's devices and what to pass instead.
    """
    if not device_ids and output_device is None:
        return None
    shown = ", ".join(sorted(str(d) for d in devices)) or "no parameters"
    both = f"device_ids={list(device_ids or [])} and output_device={output_device!r}"
    if len(devices) != 1:
        raise ValueError(
            f"{both} apply to a module on one accelerator, but the module's parameters are on "
            f"{shown}; pass neither for a module that spans devices"
        )
    if next(iter(devices)).type == "cpu":
        raise ValueError(
            f"{both} apply to a module on one accelerator, but the module's parameters are on "
            "cpu; pass neither (the default) for a CPU module, or move the module to its "
            "accelerator first"
        )
    (device,) = devices
    if not device_ids or len(device_ids) != 1:
        raise ValueError(
            f"device_ids={list(device_ids or [])}: give exactly one device per process, the "
            f"module's own ({device}), e.g. device_ids=[local_rank]"
        )
    for arg, given in (("device_ids[0]", device_ids[0]), ("output_device", output_device)):
        if given is None:
            continue
        named = torch.device(device.type, given) if isinstance(given, int) else torch.device(given)
        # A device without an index ("cuda") names the module's own, as in torch DDP.
        if named.type != device.type or named.index not in (None, device.index):
            raise ValueError(
                f"{arg} names {named}, but the module's parameters are on {device}; move the "
                f"module with .to({str(named)!r}) before wrapping it, or pass "
                f"device_ids=[{device.index}]"
            )
    return device


def mesh_group(device_mesh: Any, process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The process group of a one-dimensional ``DeviceMesh`` (torch DDP's ``device_mesh``).

    Raises:
        ValueError: a ``process_group`` was given too, or the mesh has several dimensions.
    """
    if process_group is not None:
        raise ValueError(
            "pass either process_group or device_mesh, not both: the mesh already names "
            "the group to reduce over"
        )
    if device_mesh.ndim != 1:
        names = getattr(device_mesh, "mesh_dim_names", None)
        raise ValueError(
            f"device_mesh has {device_mesh.ndim} dimensions {names or ''}; pass the "
            "one-dimensional data-parallel part of it, e.g. device_mesh['dp']"
        )
    group: dist.ProcessGroup = device_mesh.get_group(0)
    return group


def reduce_group(
    process_group: dist.ProcessGroup | None, device_mesh: Any
) -> dist.ProcessGroup | None:
    """The group to reduce over: ``process_group``, or the group of ``device_mesh``.

    Raises:
        TypeError: ``process_group`` is neither a ProcessGroup nor None.
        ValueError: this rank is not a member of ``process_group``; see also
            :func:`mesh_group`.
    """
    if device_mesh is not None:
        process_group = mesh_group(device_mesh, process_group)
    if isinstance(process_group, int) and process_group == dist.GroupMember.NON_GROUP_MEMBER:
        # What dist.new_group(ranks) returns on the ranks it leaves out: the int -100.
        raise ValueError(
            f"this rank (global rank {dist.get_rank()}) is not a member of process_group: "
            "dist.new_group(ranks) gives the ranks outside ranks a placeholder, not a group. "
            "Wrap the model only on the group's ranks (if dist.get_rank() in ranks: ...), or "
            "create the group with every rank that trains this model."
        )
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup (from "
            f"dist.new_group(), say) or None for the default group, got "
            f"{type(process_group).__name__} {process_group!r}"
        )
    return process_group
