"""The engine's options: one frozen dataclass, checked once, shared by the wrapper and strategy.

``BucketDataParallel`` builds an ``EngineOptions`` from torch DDP's keyword arguments, and
``BucketDDP`` builds one from its own and hands it to the wrapper it creates. Every check of
an option lives here, so both refuse a bad value with the same error.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._compat import ddp_deprecates_broadcast_buffers
from .buffers.policies import Policy, check_policy, check_rules

DEFAULT_BUCKET_CAP_MB = 25.0  # torch DDP's, also what its bucket_cap_mb=None means
DEFAULT_FIRST_BUCKET_MB = 1.0  # torch DDP's first bucket with its default cap
AUTO = "auto"  # a bucket size tuned on the first steps
DEFAULT_STALL_TIMEOUT = 600.0  # seconds; under the process-group timeouts (30 min by default)
_OPTIONAL_SWITCHES = frozenset({"broadcast_buffers", "forward_sync_buffers"})


@dataclass(frozen=True)
class EngineOptions:
    """What ``BucketDataParallel`` and ``BucketDDP`` are told about reducing and buffers.

    Each field but ``unused_hint`` is also a keyword argument of both, under its name.
    Construction checks them all.

    Attributes:
        bucket_cap_mb: a bucket is launched once it holds this many MB of gradients (None:
            25, torch DDP's default, as there; "auto": tuned on the first steps).
        first_bucket_mb: the cap of the first bucket, kept small so that communication
            starts early in backward (None: 1, torch DDP's with its default cap, or
            ``bucket_cap_mb`` if that is smaller; "auto": tuned on the first steps). Never
            larger than ``bucket_cap_mb``.
        find_unused_parameters: allow parameters that get no gradient in a step (control
            flow, frozen branches). Without it such a step raises an error naming them.
        gradient_as_bucket_view: make each ``param.grad`` a view into its bucket, saving
            a copy and the memory of a second gradient buffer.
        broadcast_buffers: torch DDP's switch (True if None); False is the same as
            ``default_buffer_policy="none"``, buffers keeping each rank's value from the
            start.
        buffer_sync: a policy per buffer name or fnmatch pattern (see ``docs/buffers.md``);
            it overrides the module's ``configure_buffer_sync()`` for the same key. Held as
            a read-only copy.
        default_buffer_policy: the policy of buffers no rule names ("broadcast" if None).
        static_graph: torch DDP's promise that every step runs the same graph. A parameter
            may then get several gradients in one backward (a layer shared by reentrant
            checkpoint segments), and parameters the graph never uses are allowed without
            ``find_unused_parameters``. The first synced backward counts the gradients and
            reduces at its end, without overlap.
        init_sync: broadcast parameters and buffers from rank 0 at wrapping (torch DDP's
            argument). False keeps each rank's values; the models are still checked to
            match.
        forward_sync_buffers: torch DDP 2.13's successor of ``broadcast_buffers``: False
            stops syncing buffers before each forward, but they still start from rank 0.
        check_finite: look for NaN and Inf in every gradient before it is averaged; one
            found raises an error on every rank at the end of that backward, naming the
            ranks and the parameters (see ``docs/non-finite-gradients.md``).
        telemetry: record when each bucket was ready, launched, completed and waited for,
            in ``comm_stats`` (``docs/telemetry.md``). False keeps the step totals only.
        watchdog: run the per-process watchdog (``docs/reliability.md``): an exception or
            a death on one rank ends every rank within seconds, naming that rank.
        stall_timeout: seconds a rank may wait in a collective of the engine's (or the
            strategy's) without progress before every rank stops with a report naming the
            stalled rank, its phase and every rank's Python stacks. None: no stall check
            (failures are still named). Keep it below the process group's timeout.
        unused_hint: how the error about parameters without a gradient tells the user to
            allow them; the strategy names its own option there.

    Raises:
        TypeError: an on/off option that is not a bool (0 and 1 pass), a bucket size that
            is not a number, ``buffer_sync`` that is no mapping, or a default policy that is
            neither a policy name nor callable.
        ValueError: a bucket size that is not positive and finite, a first bucket larger
            than ``bucket_cap_mb``, buffer options that contradict each other, or an unknown
            default policy name.
    """

    bucket_cap_mb: float | str = DEFAULT_BUCKET_CAP_MB
    first_bucket_mb: float | str = None  # type: ignore[assignment]  # resolved by check_bucket_sizes
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    broadcast_buffers: bool | None = None
    # Left out of the hash: a mapping has none.
    buffer_sync: Mapping[str, Policy] | None = field(default=None, hash=False)
    default_buffer_policy: Policy | None = None
    static_graph: bool = False
    init_sync: bool = True
    forward_sync_buffers: bool | None = None
    check_finite: bool = False
    telemetry: bool = True
    watchdog: bool = True
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT
    unused_hint: str = "Pass find_unused_parameters=True"

    def __post_init__(self) -> None:
        check_switches(
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            broadcast_buffers=self.broadcast_buffers,
            static_graph=self.static_graph,
            init_sync=self.init_sync,
            forward_sync_buffers=self.forward_sync_buffers,
            check_finite=self.check_finite,
            watchdog=self.watchdog,
            telemetry=self.telemetry,
        )
        check_stall_timeout(self.stall_timeout)
        cap, first = check_bucket_sizes(self.bucket_cap_mb, self.first_bucket_mb)
        object.__setattr__(self, "bucket_cap_mb", cap)
        object.__setattr__(self, "first_bucket_mb", first)
        check_rules(self.buffer_sync, "buffer_sync is")
        if self.buffer_sync is not None:
            object.__setattr__(self, "buffer_sync", types.MappingProxyType(dict(self.buffer_sync)))
        check_policy(self.buffer_policy_default, "default_buffer_policy")

    @classmethod
    def from_arguments(
        cls,
        arguments: Mapping[str, Any],
        options: EngineOptions | None = None,
        *,
        stacklevel: int = 2,
        **extra: Any,
    ) -> EngineOptions:
        """The options among a caller's ``arguments`` (its ``locals()``), or ``options``.

        The wrapper and the strategy take every engine option as a keyword of their own;
        this picks them out by name, so that neither lists them twice. ``extra`` adds
        fields that are not keywords of theirs (``unused_hint``). Options built from the
        keywords warn as torch DDP does (:func:`warn_deprecated`), at the frame
        ``stacklevel`` above the caller (the user's line, by default).
        """
        names = [f.name for f in dataclasses.fields(cls)]
        given = {name: arguments[name] for name in names if name in arguments}
        built = cls.from_keywords(options, **given, **extra)
        if options is None:
            warn_deprecated(built, stacklevel + 2)
        return built

    @classmethod
    def from_keywords(cls, options: EngineOptions | None = None, /, **given: Any) -> EngineOptions:
        """The options from a wrapper's keyword arguments, or ``options`` itself.

        ``given`` holds every engine keyword the caller takes, at its value; None for a
        bucket size means its default, as in torch DDP.

        Raises:
            TypeError: ``options`` is no ``EngineOptions``, or is given together with a
                keyword that differs from its default (naming them); see also the class.
        """
        if options is None:
            return cls(**given)
        if not isinstance(options, EngineOptions):
            raise TypeError(
                f"options must be an EngineOptions or None, got {type(options).__name__}"
            )
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        clash = [
            name
            for name, value in given.items()
            if not (value is None and name in ("bucket_cap_mb", "first_bucket_mb"))
            and value is not defaults[name]
            and value != defaults[name]
        ]
        if clash:
            raise TypeError(
                f"{', '.join(clash)} given together with options=: pass each engine option "
                f"once, in options (options.replace({clash[0]}=...)) or as a keyword"
            )
        return options

    @property
    def bucket_sizes(self) -> tuple[float, float]:
        """Both bucket sizes in MB, with torch DDP's defaults where they are tuned."""
        cap, first = self.bucket_cap_mb, self.first_bucket_mb
        return (
            DEFAULT_BUCKET_CAP_MB if isinstance(cap, str) else cap,
            DEFAULT_FIRST_BUCKET_MB if isinstance(first, str) else first,
        )

    @property
    def tuned_sizes(self) -> tuple[float | None, float | None] | None:
        """(cap, first) with None for each size to tune, or None if neither is."""
        cap, first = self.bucket_cap_mb, self.first_bucket_mb
        if not (isinstance(cap, str) or isinstance(first, str)):
            return None
        return (None if isinstance(cap, str) else cap, None if isinstance(first, str) else first)

    @property
    def buffer_policy_default(self) -> Policy:
        """The policy of buffers no rule names, from the three buffer options together."""
        return buffer_default(
            self.broadcast_buffers, self.forward_sync_buffers, self.default_buffer_policy
        )

    def replace(self, **changes: Any) -> EngineOptions:
        """A copy with ``changes`` applied, checked like a new one.

        A first bucket at its default follows a new ``bucket_cap_mb``.
        """
        if "first_bucket_mb" not in changes and self.first_bucket_mb == min(
            DEFAULT_FIRST_BUCKET_MB, self.bucket_cap_mb
        ):
            changes["first_bucket_mb"] = None
        return dataclasses.replace(self, **changes)

    def keywords(self) -> dict[str, Any]:
        """The options as the wrapper's keyword arguments (``unused_hint`` is not one)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del out["unused_hint"]
        if self.buffer_sync is not None:
            out["buffer_sync"] = dict(self.buffer_sync)
        return out

    def __getstate__(self) -> dict[str, Any]:
        # Pickling and copy.deepcopy (of a wrapper): a mappingproxy cannot be pickled.
        state = self.__dict__.copy()
        if self.buffer_sync is not None:
            state["buffer_sync"] = dict(self.buffer_sync)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        rules = state["buffer_sync"]
        if rules is not None:
            state = {**state, "buffer_sync": types.MappingProxyType(rules)}
        for name, value in state.items():
            object.__setattr__(self, name, value)


class ForwardSyncSwitch:
    """A wrapper's ``forward_sync_buffers`` attribute: whether buffers sync before forwards.

    torch DDP 2.13's attribute (``broadcast_buffers`` is its older name). False when
    wrapped with ``forward_sync_buffers=False``, ``broadcast_buffers=False`` or
    ``default_buffer_policy="none"``. Set to False, it stops every buffer sync before
    forwards, ``buffer_sync`` rules included; set to True, it starts them again.
    """

    def __get__(self, wrapper: Any, owner: type | None = None) -> Any:
        if wrapper is None:
            return self
        return wrapper.options.buffer_policy_default != "none" and not wrapper.buffers_sync.paused

    def __set__(self, wrapper: Any, value: bool) -> None:
        """Raises TypeError unless ``value`` is a bool, and ValueError for True on a wrapper
        whose buffers were made rank-local at wrapping."""
        if value not in (True, False):
            raise TypeError(f"forward_sync_buffers must be True or False, got {value!r}")
        if value and wrapper.options.buffer_policy_default == "none":
            raise ValueError(
                "forward_sync_buffers cannot be switched on after wrapping with "
                "forward_sync_buffers=False (or broadcast_buffers=False, or "
                'default_buffer_policy="none"): the buffers were made rank-local then. Wrap '
                "the model with forward_sync_buffers=True instead."
            )
        wrapper.buffers_sync.paused = not value


def check_switches(**switches: object) -> None:
    """Raise if an on/off option holds something other than True or False (or None).

    None is allowed for the options whose default it is (``broadcast_buffers``,
    ``forward_sync_buffers``); 0 and 1 pass as well. Anything else, a string from a
    command line above all (``"False"`` is true in Python), would silently switch the
    option on, so it is refused.

    Raises:
        TypeError: naming the first such option and its value.
    """
    for name, value in switches.items():
        if value is None and name in _OPTIONAL_SWITCHES:
            continue
        if isinstance(value, numbers.Integral) and value in (0, 1):  # bools included
            continue
        allowed = "True, False or None" if name in _OPTIONAL_SWITCHES else "True or False"
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}")


def check_stall_timeout(value: object) -> None:
    """Raise unless ``value`` is None or a positive, finite number of seconds."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"stall_timeout must be a number of seconds or None (no stall check), got "
            f"{type(value).__name__} {value!r}"
        )
    if not 0 < float(value) < math.inf:
        raise ValueError(
            f"stall_timeout must be a positive, finite number of seconds, got {value}; pass "
            "None to switch the stall check off"
        )


def check_bucket_sizes(
    bucket_cap_mb: float | str | None, first_bucket_mb: float | str | None
) -> tuple[float | str, float | str]:
    """Check both bucket sizes and return them in MB, or ``"auto"``.

    ``None`` means the default: 25 MB for ``bucket_cap_mb`` (as torch DDP's None does), and
    for ``first_bucket_mb`` 1 MB, or ``bucket_cap_mb`` if that is smaller. ``"auto"`` means
    tuned on the first steps (``docs/bucket-sizes.md``).

    Raises:
        TypeError: a size that is not a number.
        ValueError: a size that is not positive and finite, or a first bucket larger than
            the others.
    """
    cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    first = first_bucket_mb
    out: list[float | str] = []
    for name, value, default in (
        ("bucket_cap_mb", cap, DEFAULT_BUCKET_CAP_MB),
        ("first_bucket_mb", DEFAULT_FIRST_BUCKET_MB if first is None else first, 1.0),
    ):
        if value == AUTO and isinstance(value, str):
            out.append(AUTO)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f'{name} must be a number of megabytes or "auto" (the default is {default}), '
                f"got {type(value).__name__} {value!r}"
            )
        if not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive, finite number of megabytes, got {value}")
        out.append(float(value))
    cap, first = out
    if first_bucket_mb is None:
        first = (
            DEFAULT_FIRST_BUCKET_MB if isinstance(cap, str) else min(DEFAULT_FIRST_BUCKET_MB, cap)
        )
    elif not isinstance(first, str) and not isinstance(cap, str) and first > cap:
        raise ValueError(
            f"first_bucket_mb={first} is larger than bucket_cap_mb={cap}: the first "
            "bucket is the small one, so that communication starts early in backward. Pass "
            f"first_bucket_mb <= {cap}, or leave it out (1 MB, or bucket_cap_mb if smaller)."
        )
    return cap, first


BROADCAST_BUFFERS_DEPRECATED = (
    "broadcast_buffers is deprecated, as in torch's DistributedDataParallel of this torch "
    "release: pass forward_sync_buffers instead (False stops syncing buffers before each "
    "forward; they still start from rank 0). For buffers that keep each rank's own value "
    "from the start, which broadcast_buffers=False also meant, pass "
    'default_buffer_policy="none".'
)


def warn_deprecated(options: EngineOptions, stacklevel: int) -> None:
    """Warn where torch DDP would: a FutureWarning for ``broadcast_buffers``, when given and
    this torch's DDP deprecates it (torch 2.13 on, see ``_compat``)."""
    if options.broadcast_buffers is not None and ddp_deprecates_broadcast_buffers():
        warnings.warn(BROADCAST_BUFFERS_DEPRECATED, FutureWarning, stacklevel=stacklevel)


def buffer_default(
    broadcast_buffers: bool | None,
    forward_sync_buffers: bool | None,
    default_buffer_policy: Policy | None,
) -> Policy:
    """The policy of buffers no rule names, from the wrapper's three buffer options.

    ``broadcast_buffers`` and ``forward_sync_buffers`` are torch DDP's switches (the second
    replaces the first in torch 2.13); False means ``"none"``, None means not given.

    Raises:
        ValueError: the options contradict each other, naming them.
    """
    given = {
        name: value
        for name, value in (
            ("broadcast_buffers", broadcast_buffers),
            ("forward_sync_buffers", forward_sync_buffers),
        )
        if value is not None
    }
    if len(set(given.values())) > 1:
        raise ValueError(
            f"broadcast_buffers={broadcast_buffers} contradicts forward_sync_buffers="
            f"{forward_sync_buffers}; pass only forward_sync_buffers (torch 2.13's name)"
        )
    if default_buffer_policy is None:
        return "none" if False in given.values() else "broadcast"
    for switch in given.values():
        # False means no sync, True a sync: "none", or any other policy, contradicts it.
        if switch is (default_buffer_policy == "none"):
            name = next(iter(given))
            raise ValueError(
                f"{name}={switch} contradicts default_buffer_policy={default_buffer_policy!r}; "
                "pass only one of them"
            )
    return default_buffer_policy
