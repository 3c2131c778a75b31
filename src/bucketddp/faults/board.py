"""The fault board: what the ranks tell each other about failures, through the store.

The board lives on the rendezvous store the default process group was created with
(TCPStore under torchrun, Lightning and ``init_method="tcp://"``; a FileStore works too),
on a client connection of its own, so that a blocking ``get`` of the process group's never
holds up the watchdog. No transport of our own: keys under ``bucketddp/faults/``, one
namespace per torchrun attempt (torchrun's store outlives the workers it restarts).

The connection is opened by ``connect()``, on the watchdog's thread: opening one can take
seconds (the store's host resolves each new client's address, and a slow name server
holds every new connection up), and building a wrapper must not wait for it, except on
torch 2.5 and 2.6, where building a store beside a busy thread is not safe
(``_compat.store_built_unsafely``, ``monitor.py``).

Keys (one writer each, except the counters):
    events          counter, bumped after each fault record or stall alarm: the one key
                    every rank polls
    faults          append-only log of fault records, one JSON object per line
    alarm           counter: a rank saw itself wait longer than the stall timeout
    reports         append-only log of stall reports (phase, step, stacks), one per line
    beat/<rank>     each rank's progress, rewritten by its watchdog every interval

The keys outlive a watchdog: a process that trains again in the same process group (a
second ``fit`` after a failed one, in a notebook or a test) finds the last run's faults and
alarm there. Each board takes what its store already holds as the past (``start``, on the
caller's thread, before the wrapper's first collective) and reads only what came after.
"""

from __future__ import annotations

import json
import os
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._compat import connection_keys, store_connection

PREFIX = "bucketddp/faults"
STORE_TIMEOUT = timedelta(seconds=10)  # for each call on the board
CONNECT_TIMEOUT = timedelta(seconds=15)  # for opening the connection


class NotConnected(RuntimeError):
    """The board's store connection is not open (yet)."""


def default_store() -> dist.Store:
    """The store the default process group was created with."""
    return dist.distributed_c10d._get_default_store()


def namespace() -> str:
    """The board's key prefix: one per torchrun attempt, whose store keeps earlier keys."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return PREFIX if run is None or attempt is None else f"{PREFIX}/{run}/{attempt}"


class Board:
    """One rank's view of the fault board; ``connect()`` opens it (no I/O before)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        self._source = store
        # Typed Any: the stubs lack append, which every c10d store has.
        self._own: Any = None
        self._connected = threading.Event()
        self.rank = rank
        self.world_size = world_size
        # What the store held when this board started: earlier runs' records, skipped.
        self._past_faults = 0
        self._past_reports = 0
        self._past_alarms = 0
        self.past_events = 0

    def start(self) -> None:
        """Take what the board's keys hold now as an earlier run's, and clear this rank's
        beat; on the caller's thread, over the store's open connection (no new one).

        Called before the wrapper's first collective: no other rank can have failed in
        this run yet, and the earlier run's ranks posted before they reached it.
        """
        view = dist.PrefixStore(namespace(), connection_keys(self._source))
        self.past_events = int(view.add("events", 0))
        if self.past_events:
            self._past_faults = _count(view, "faults")
            self._past_reports = _count(view, "reports")
            self._past_alarms = int(view.add("alarm", 0))
        # A beat left by this rank's last watchdog would look like a silent one.
        view.delete_key(f"beat/{self.rank}")

    def connect(self) -> None:
        """Open the board's own store connection; raises what the store raises."""
        own = store_connection(self._source, CONNECT_TIMEOUT)
        if own is not self._source:
            own.set_timeout(STORE_TIMEOUT)
        self._own = dist.PrefixStore(namespace(), own)
        self._connected.set()

    def wait_connected(self, timeout: float) -> bool:
        """Whether the connection is open, waiting up to ``timeout`` s for it."""
        return self._connected.wait(timeout)

    @property
    def _store(self) -> Any:
        if self._own is None:
            raise NotConnected("the fault board's store connection is not open")
        return self._own

    # -- what every rank does every interval
    def beat(self, value: str) -> None:
        """Tell the others this rank's watchdog is alive (``value`` changes each time)."""
        self._store.set(f"beat/{self.rank}", value)

    def events(self) -> int:
        """How many faults and alarms were posted so far."""
        return int(self._store.add("events", 0))

    # -- faults
    def post_fault(self, record: dict[str, Any]) -> None:
        """Add a fault record to the log and tell every rank."""
        self._store.append("faults", json.dumps(record) + "\n")
        self._store.add("events", 1)

    def faults(self) -> list[dict[str, Any]]:
        """Every fault record posted since this board started, oldest first."""
        if not self._store.check(["faults"]):
            return []
        return _records(self._store.get("faults"))[self._past_faults :]

    # -- stalls
    def raise_alarm(self) -> None:
        """Tell every rank that this one has waited longer than the stall timeout."""
        self._store.add("alarm", 1)
        self._store.add("events", 1)

    def alarmed(self) -> bool:
        """Whether some rank raised the stall alarm since this board started."""
        return int(self._store.add("alarm", 0)) > self._past_alarms

    def post_report(self, record: dict[str, Any]) -> None:
        """Add this rank's stall report (phase, step, stacks)."""
        self._store.append("reports", json.dumps(record) + "\n")

    def reports(self) -> list[dict[str, Any]]:
        """The stall reports posted since this board started."""
        if not self._store.check(["reports"]):
            return []
        return _records(self._store.get("reports"))[self._past_reports :]

    # -- liveness
    def beat_of(self, rank: int) -> str | None:
        """Rank ``rank``'s last beat, or None before its first."""
        key = f"beat/{rank}"
        if not self._store.check([key]):
            return None
        return self._store.get(key).decode()


def _records(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def _count(store: Any, key: str) -> int:
    """How many records the log ``key`` holds."""
    return len(_records(store.get(key))) if store.check([key]) else 0
