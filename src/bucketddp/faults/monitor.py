"""The watchdog: one thread per process that makes a failure on one rank end every rank.

Every ``INTERVAL`` seconds the thread writes this rank's heartbeat to the fault board
(``board.py``) and reads one counter. It ends this rank, from the main thread where it can:

- when another rank posted a fault: an exception that escaped its training (posted by
  ``sys.excepthook`` or the Lightning strategy), a child process this one launched that died
  of a signal, or a neighbour whose heartbeat stopped while this rank waited for it;
- when some rank waited in a collective for longer than the stall timeout: every rank then
  posts its phase and its Python stacks, and all raise the same report.

Ending a rank means raising ``RankFailedError`` or ``RankStalledError`` in its main thread
(through a signal, so a sleep or a lock wait is interrupted too). A main thread that cannot
take the exception within ``GRACE`` seconds (stuck in C++, as in a collective with a peer
that will never answer) is ended with exit code 1 after the report is printed, and after
the callbacks of ``last_words.py`` ran (``os._exit`` skips ``atexit``).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref
from types import FrameType, TracebackType
from typing import Any, Protocol

import torch.distributed as dist

from .._compat import SAFE_STORE_TORCH, store_built_unsafely
from ..notice import Preempted
from ..reducer.inflight import describe
from ..reducer.state import ReducerState
from . import last_words
from . import progress as prog
from .board import CONNECT_TIMEOUT, Board, default_store
from .foreign import collective_of
from .report import RankFailedError, RankStalledError, failed_message, stall_message

INTERVAL = 0.5  # seconds between heartbeats
PEER_DELAY = 1.0  # a rank failing by itself at the same point gets to say so first
GRACE = 5.0  # seconds the main thread has to take the exception before the exit
NEIGHBOUR_AFTER = 2.0  # waiting this long, a rank starts watching its neighbour's heartbeat
SILENT_AFTER = 3.0  # a heartbeat unchanged this long means the rank is gone
# ... and unchanged over this many of our own beats, so that a store that held every
# client up for a while (its host resolving a new client's name) is not taken for silence
SILENT_BEATS = int(SILENT_AFTER / INTERVAL)
REPORT_WAIT = 3.0  # how long a stalled job waits for every rank's report
CONNECT_SLACK = 5.0  # beyond the store's connect timeout, for its own name lookups
ONE_TRY = (
    "bucketddp: the watchdog cannot reach the store ({error}); failures are not named in "
    "this run. On torch older than {safe} it tries once, as the wrapper is built: a store "
    "connection opened while training runs can abort the process there (pytorch#143593). "
    "Upgrade torch to {safe} or newer to have it try until it connects."
)
INTERRUPT = getattr(signal, "SIGUSR2", None)
_ERRORS = (RankFailedError, RankStalledError)


class Engine(Protocol):
    """What the watchdog reads of a wrapper: its reducer."""

    @property
    def reducer(self) -> ReducerState:
        """The wrapper's reducer."""
        ...


_HOST = socket.gethostname()


def _stacks() -> str:
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def _note(exc: BaseException, text: str) -> None:
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(text)
    else:  # Python 3.10
        print(text, file=sys.stderr, flush=True)


class Watchdog:
    """The per-process watchdog of one job (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, engine: Engine) -> None:
        self.board = Board(store, rank, world_size)
        with contextlib.suppress(Exception):  # a store without these calls: read it all
            self.board.start()
        self.rank = rank
        self.world_size = world_size
        self.stall_timeout: float | None = None
        # The wrappers watched; the watchdog ends when the last one is released or collected.
        self.engines: weakref.WeakSet[Any] = weakref.WeakSet([engine])
        self.children: dict[int, Any] = {}  # rank -> Popen, for a launcher's processes
        self._seen_events = self.board.past_events
        prog.PROGRESS.new_run()  # a failure is named at this run's step, not the process's
        self._peer_faults: list[dict[str, Any]] = []
        self._peer_seen_at: float | None = None
        self._failing = False  # this rank's own exception is on its way out
        self._posted = False  # and was reported
        self._pending: tuple[type[RuntimeError], str] | None = None
        self._interrupted_at: float | None = None
        self._taken = False  # the main thread took the exception
        self._alarm_raised = False
        self._warned = False
        self._board_gone = False  # the store stopped answering
        self._reported = False
        self._neighbour: tuple[str, float, int] | None = None  # (beat, seen at, our beat no.)
        self._beats = 0
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._main_thread = self._main  # whose frames ``state`` reads
        self._previous_hook = sys.excepthook
        self._previous_signal: Any = None
        if INTERRUPT is not None and threading.current_thread() is threading.main_thread():
            self._previous_signal = signal.signal(INTERRUPT, self._on_signal)
        else:
            self._main = None  # no handler: a stuck or busy main thread gets the exit
        sys.excepthook = self._excepthook
        atexit.register(self.stop)
        # Everything that touches the store, opening the connection first, runs on this thread.
        self._tried = threading.Event()  # its first try to connect is over
        self._thread = threading.Thread(target=self._run, name="bucketddp-watchdog", daemon=True)
        self._thread.start()
        if store_built_unsafely():
            # This torch builds the connection's TCPStore with the GIL released throughout
            # (_compat): until it is built, this thread makes no torch.distributed object.
            self._tried.wait(CONNECT_TIMEOUT.total_seconds() + CONNECT_SLACK)

    # ------------------------------------------------------------- the main thread
    def report_exception(self, exc: BaseException) -> None:
        """This rank's training ends with ``exc``: tell the others, or explain ``exc``.

        An error caused by another rank's failure (ours, or a collective's error after a
        peer died) gets a note naming that rank instead of being posted as the cause.
        """
        if self._posted or self._stop.is_set():
            return
        self._posted = True
        self._failing = True
        secondary = isinstance(exc, _ERRORS) or bool(self._peer_faults) or _collective(exc)
        if secondary and not isinstance(exc, _ERRORS):
            explained = self.explain()
            if explained:
                _note(exc, f"bucketddp: {explained}")
        if (isinstance(exc, SystemExit) and exc.code in (None, 0)) or isinstance(exc, Preempted):
            return  # a clean exit, or every rank stopping together on a notice
        record = self._record(kind="raised", secondary=secondary)
        record.update(type=type(exc).__name__, message=str(exc)[:2000])
        # A failure in the first moments may come before the connection is open.
        self.board.wait_connected(CONNECT_TIMEOUT.total_seconds())
        with contextlib.suppress(Exception):  # the store is gone: nobody to tell
            self.board.post_fault(record)

    def explain(self, wait: float = SILENT_AFTER + 1.0) -> str | None:
        """Why the other ranks stopped answering, from the board; waits up to ``wait`` s."""
        if not self.board.wait_connected(wait):
            return None  # the watchdog never reached the store: nothing to go by
        deadline = time.monotonic() + wait
        others = [r for r in range(self.world_size) if r != self.rank]
        first: dict[int, str | None] = {}
        started = time.monotonic()
        try:
            while True:
                faults = [f for f in self.board.faults() if f["rank"] != self.rank]
                if faults:
                    return failed_message(self.rank, faults)
                beats = {r: self.board.beat_of(r) for r in others}
                first = first or beats
                if time.monotonic() - started >= SILENT_AFTER:
                    gone = self._gone(others, first, beats, time.monotonic() - started)
                    if gone:
                        return failed_message(self.rank, gone)
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.25)
        except Exception:
            return failed_message(self.rank, [_unreachable()])

    def _gone(
        self,
        ranks: list[int],
        before: dict[int, str | None],
        now: dict[int, str | None],
        silent_s: float,
    ) -> list[dict[str, Any]]:
        out = []
        for r in ranks:
            if now[r] is not None and now[r] != before.get(r):
                continue
            beat = now[r]
            last = json.loads(beat) if beat else {"rank": r}
            out.append({**last, "rank": r, "kind": "died", "silent_s": silent_s})
        return out

    def _excepthook(
        self, kind: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        if not isinstance(exc, KeyboardInterrupt | SystemExit):
            self.report_exception(exc)
        self._previous_hook(kind, exc, tb)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        pending = self._pending
        if pending is None or self._taken:
            previous = self._previous_signal
            if callable(previous):
                previous(signum, frame)
            return
        self._taken = True
        self._failing = True
        raise pending[0](pending[1])

    def ended(self) -> bool:
        """Whether this rank's training under this watchdog failed (it posted or took an
        error): a wrapper built afterwards gets a new watchdog, which ignores that failure."""
        return self._posted or self._pending is not None

    def stop(self) -> None:
        """Stop watching, and wait for the thread to end (an exit, a teardown, ...)."""
        # No last word to the store: its host (rank 0) may have exited first, and c10d
        # would print a warning for the broken connection.
        self._stop.set()
        atexit.unregister(self.stop)
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            # Let the thread leave its store call first: a daemon thread that comes back
            # from C++ while the interpreter shuts down ends the process with SIGABRT.
            self._thread.join(CONNECT_TIMEOUT.total_seconds())

    def release(self, engine: object) -> None:
        """``engine`` is done (its strategy tore down); the last one stops the watchdog."""
        self.engines.discard(engine)
        if not self.engines:
            self.stop()

    # ----------------------------------------------------------- the watchdog thread
    def _connect(self) -> bool:
        """Open the board's connection, trying again until it opens or watching ends.

        Where building a store beside the training can abort it (``_compat``), one try
        only, made while the thread that built the wrapper waits: no later try can be made
        safely, so a watchdog that could not connect then names no failure in this run.
        """
        warned = False
        while not self._stop.is_set() and dist.is_initialized():
            try:
                self.board.connect()
                return True
            except Exception as e:
                if store_built_unsafely():
                    message = ONE_TRY.format(error=e, safe=SAFE_STORE_TORCH)
                    print(message, file=sys.stderr, flush=True)
                    return False
                if not warned:
                    warned = True
                    print(
                        f"bucketddp: the watchdog cannot reach the store yet ({e}); failures "
                        "are not named until it does. Trying again.",
                        file=sys.stderr,
                        flush=True,
                    )
            self._stop.wait(INTERVAL)
        return False

    def _run(self) -> None:
        try:
            connected = self._connect()
        finally:
            self._tried.set()
        if not connected:
            return
        n = 0
        while True:
            if n and self._stop.wait(INTERVAL):
                return
            if not dist.is_initialized() or not self.engines:
                # The group was destroyed, or every wrapper was collected: nothing to watch.
                self.stop()
                return
            if self._board_gone:
                if self._interrupted_at is None:
                    return  # nothing left to watch, nobody to end
                self._exit_if_stuck()
                continue
            try:
                n += 1
                self.board.beat(json.dumps(self._record(kind="beat", n=n)))
                self._beats = n
                events = self.board.events()
                if events != self._seen_events:
                    self._seen_events = events
                    self._on_events()
                self._watch_children()
                waiting, _, idle = self.state()
                if waiting and idle > NEIGHBOUR_AFTER:
                    self._watch_neighbour()
                else:
                    self._neighbour = None
                timeout = self.stall_timeout
                if waiting and timeout is not None and idle > timeout and not self._alarm_raised:
                    self._alarm_raised = True
                    self.board.raise_alarm()
            except Exception as e:
                self._on_error(e)
            self._peer_check()
            self._exit_if_stuck()

    def _on_error(self, error: Exception) -> None:
        if _store_lost(error):
            # The store stopped answering: its host (rank 0) is gone. That ends this rank
            # only while it waits on the others; otherwise the job may just be over. Either
            # way there is no board left to watch (and each try would print c10d's warning).
            waiting, _, _ = self.state()
            if waiting and self._pending is None and not self._failing:
                self._end(RankFailedError, failed_message(self.rank, [_unreachable()]))
            self._board_gone = True
            return
        if not self._warned:
            self._warned = True
            print(f"bucketddp: the watchdog hit {error!r}", file=sys.stderr, flush=True)

    def state(self) -> tuple[bool, str, float]:
        """(waiting on the other ranks, what this rank is doing, seconds since progress)."""
        p = prog.PROGRESS
        waiting = p.phase in prog.WAITING
        detail = prog.describe(p.phase, p.detail)
        for engine in list(self.engines):
            reducer = getattr(engine, "reducer", None)
            if reducer is None:
                continue
            in_flight, what = describe(reducer)
            if what:
                waiting = waiting or in_flight
                detail = what
                break
        found = None if waiting else collective_of(self._main_thread)
        if found is not None and not found[1]:
            # A collective bucketddp did not launch (a user's, or Lightning's SIGTERM
            # handler's): no mark shows it. (bucketddp's own unmarked ones, in setup, keep
            # their phase: setup is not held to the stall timeout.)
            waiting = True
            detail = f"{found[0]}: a collective bucketddp did not launch"
        return waiting, detail, p.idle()

    def _record(self, **extra: Any) -> dict[str, Any]:
        p = prog.PROGRESS
        return {
            "rank": self.rank,
            "host": _HOST,
            "pid": os.getpid(),
            "step": p.step,
            "phase": p.phase,
            "time": time.time(),
            **extra,
        }

    def _on_events(self) -> None:
        faults = [f for f in self.board.faults() if f["rank"] != self.rank]
        if faults and not self._peer_faults:
            self._peer_seen_at = time.monotonic()
            if not self._failing:
                # Said at once: a launcher may end this process before the error is raised.
                print(
                    f"bucketddp: {failed_message(self.rank, faults)}", file=sys.stderr, flush=True
                )
        self._peer_faults = faults
        if not self._reported and self.board.alarmed():
            self._reported = True
            self._stall_report()

    def _peer_check(self) -> None:
        seen = self._peer_seen_at
        if seen is None or self._failing or self._pending is not None:
            return
        if time.monotonic() - seen >= PEER_DELAY:
            self._end(RankFailedError, failed_message(self.rank, self._peer_faults))

    def _stall_report(self) -> None:
        waiting, detail, idle = self.state()
        record = self._record(waiting=waiting, detail=detail, idle=idle, stacks=_stacks())
        self.board.post_report(record)
        deadline = time.monotonic() + REPORT_WAIT
        reports = self.board.reports()
        while len(reports) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.2)
            reports = self.board.reports()
        timeout = self.stall_timeout if self.stall_timeout is not None else 0.0
        if self._pending is None and not self._failing:
            self._end(RankStalledError, stall_message(self.rank, reports, self.world_size, timeout))

    def _watch_children(self) -> None:
        for rank, proc in list(self.children.items()):
            code = proc.poll()
            if code is None or code == 0:
                continue
            del self.children[rank]
            if code < 0:
                name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
                record = {"rank": rank, "host": _HOST, "pid": proc.pid, "kind": "signal"}
                self.board.post_fault({**record, "signal": name, "seen_by": self.rank})

    def _watch_neighbour(self) -> None:
        rank = (self.rank + 1) % self.world_size
        beat = self.board.beat_of(rank)
        if beat is None:
            return  # its watchdog has not reached the store yet: no silence to judge
        now = time.monotonic()
        if self._neighbour is None or self._neighbour[0] != beat:
            self._neighbour = (beat, now, self._beats)
            return
        silent = now - self._neighbour[1]
        if silent < SILENT_AFTER or self._beats - self._neighbour[2] < SILENT_BEATS:
            return
        last = json.loads(beat)
        self.board.post_fault(
            {**last, "rank": rank, "kind": "died", "silent_s": silent, "seen_by": self.rank}
        )
        self._neighbour = None

    def _end(self, kind: type[RuntimeError], message: str) -> None:
        if kind is not RankFailedError or self._peer_seen_at is None:
            print(f"bucketddp: {message}", file=sys.stderr, flush=True)
        self._pending = (kind, message)
        self._interrupted_at = time.monotonic()
        record = self._record(kind="raised", secondary=True)
        with contextlib.suppress(Exception):
            self.board.post_fault({**record, "type": kind.__name__, "message": message[:500]})
        if self._main is not None and INTERRUPT is not None:
            signal.pthread_kill(self._main, INTERRUPT)

    def _exit_if_stuck(self) -> None:
        at = self._interrupted_at
        if at is None or self._taken or time.monotonic() - at < GRACE:
            return
        print(
            f"bucketddp: rank {self.rank}'s main thread did not take the error within "
            f"{GRACE:g} s (it is stuck outside Python, e.g. in a collective): exiting with "
            "code 1",
            file=sys.stderr,
            flush=True,
        )
        for proc in self.children.values():
            if proc.poll() is None:
                proc.kill()
        last_words.run()
        os._exit(1)


def _unreachable() -> dict[str, Any]:
    # Under torchrun the workers' store is its agent's (on the first node), not rank 0's.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return {"rank": 0, "kind": "unreachable", "agent": agent}


def _store_lost(exc: BaseException) -> bool:
    """Whether a store call failed because the store's host is gone."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        s in text for s in ("Broken pipe", "Connection reset", "Connection refused", "closed")
    )


def _collective(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that failed because a peer went away."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection reset", "Connection closed", "Timed out", "gloo", "NCCL")
    )


_WATCHDOG: Watchdog | None = None
_LOCK = threading.Lock()


def watch(engine: Engine, stall_timeout: float | None) -> Watchdog | None:
    """Start this process's watchdog if needed, and have it watch ``engine``."""
    global _WATCHDOG
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    with _LOCK:
        if _WATCHDOG is not None and _WATCHDOG.ended():
            _WATCHDOG.stop()  # its training failed: a new one serves the next
        if _WATCHDOG is None or _WATCHDOG._stop.is_set():
            _WATCHDOG = Watchdog(default_store(), dist.get_rank(), dist.get_world_size(), engine)
            _WATCHDOG.children.update(_ADOPTED)
        dog = _WATCHDOG
        dog.engines.add(engine)
    if stall_timeout is not None:
        current = dog.stall_timeout
        dog.stall_timeout = stall_timeout if current is None else min(current, stall_timeout)
    return dog


def release(engine: Engine) -> None:
    """``engine``'s strategy tore down: the watchdog ends if it watched nothing else."""
    dog = current()
    if dog is not None:
        dog.release(engine)


def current() -> Watchdog | None:
    """This process's running watchdog, if any."""
    dog = _WATCHDOG
    return dog if dog is not None and not dog._stop.is_set() else None


_ADOPTED: dict[int, Any] = {}


def adopt_children(children: dict[int, Any]) -> None:
    """Processes this one launched, by rank: the watchdog names their deaths by signal."""
    _ADOPTED.update(children)
    dog = current()
    if dog is not None:
        dog.children.update(children)
