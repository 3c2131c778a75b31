"""The one rank launcher every distributed test and benchmark uses: run a function on N ranks.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, joins them in a real
process group (gloo unless a test asks for nccl) on a free loopback port, calls ``fn(rank,
world_size, *args)`` on each and returns the per-rank results in rank order. A rank that
raises fails the call with that rank's traceback; a run that outlives ``timeout`` seconds is
killed and fails with the list of ranks still running, so a hang in the code under test
shows up as a test failure. Either way the message carries the Python stack of every
thread of a rank that hung (ended with SIGABRT, so that ``faulthandler`` writes them out
before the rank dies) or died of a signal (an abort, a segfault).

Processes come from a forkserver that has torch preloaded, so a rank starts in a fraction
of a second instead of re-importing torch. ``MULTIRANK_PRELOAD`` (module names, comma
separated) adds to what it imports: the test suite sets ``torch._dynamo``
(tests/conftest.py), for itself and the benchmark runs it starts. ``fresh=True`` starts the
ranks in new interpreters instead, for a check of what a program imports. Each rank runs
one intra-op thread, and the parent sleeps on the ranks' pipes while they run, so the ranks
of a benchmark have the machine's cores to themselves. It lives in ``tools/``, which the
tests (pytest's ``pythonpath``) and the benchmarks put on ``sys.path``.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, cast

import torch
import torch.distributed as dist

_CTX = mp.get_context("forkserver")
_EXTRA = [name for name in os.environ.get("MULTIRANK_PRELOAD", "").split(",") if name]
_CTX.set_forkserver_preload(["torch", "torch.distributed", "bucketddp", *_EXTRA])
_FRESH = mp.get_context("spawn")


class RankError(AssertionError):
    """A rank raised; the message carries its traceback."""


def raised(fn: Callable[[], object], kind: type[Exception] = RuntimeError) -> str:
    """The message of the ``kind`` of error ``fn()`` raises on this rank (for error tests)."""
    try:
        fn()
    except kind as e:
        return str(e)
    return "nothing raised"


HANG_GUARD = 60.0  # seconds: waits for an event that comes at once unless something hangs


def _watchdogs() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "bucketddp-watchdog" and t.is_alive()]


def watchdog_threads() -> int:
    """How many bucketddp watchdog threads run in this process (for lifetime checks)."""
    return len(_watchdogs())


def watchdog_threads_after_they_end(timeout: float = HANG_GUARD) -> int:
    """Wait for every running watchdog thread to end (a hang guard of ``timeout`` s in all);
    returns how many still run. For a watchdog that ends at its next beat by itself."""
    deadline = time.monotonic() + timeout
    for thread in _watchdogs():
        thread.join(max(0.0, deadline - time.monotonic()))
    return watchdog_threads()


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not; Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago, never one handed out before by
    this process (jobs started side by side must not share a store's port)."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("free_port: the system gave only ports handed out already (64 tries)")


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    args: tuple[Any, ...],
    env: dict[str, str],
    backend: str,
    conn: Any,
    stack_path: str,
) -> None:
    # One intra-op thread per rank: the ranks share this machine's cores, and oversubscribed
    # threads would make a benchmark measure the scheduler rather than the code.
    torch.set_num_threads(1)
    # Every thread's Python stack goes to stack_path if the rank dies of a signal, which is
    # also how the parent ends a rank that hangs (SIGABRT).
    stacks = open(stack_path, "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.enable(file=stacks, all_threads=True)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        try:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout),
            )
        except Exception:
            # The helper's own group did not form: ``fn`` has not run (see FORMING).
            conn.send(("error", (time.time(), traceback.format_exc(), FORMING)))
            return
        result = fn(rank, world_size, *args)
        conn.send(("ok", _to_bytes(result)))
    except BaseException:
        conn.send(("error", (time.time(), traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def _first_failure(errors: dict[int, tuple[float, str]], world_size: int) -> str:
    """The message of the rank that failed first, in full (the others' errors usually follow
    from it: a peer that left resets their connections), then each other's last line."""
    order = sorted(errors, key=lambda r: (errors[r][0], r))
    first = order[0]
    text = f"rank {first} of {world_size} failed first:\n{errors[first][1]}"
    for rank in order[1:]:
        lines = errors[rank][1].strip().splitlines() or [""]
        text += f"\nthen rank {rank}: {lines[-1]}"
    return text


def _stacks(path: str) -> str:
    """What faulthandler wrote for one rank, as a message suffix ("" if nothing)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return ""
    return f"\nits threads' Python stacks (faulthandler):\n{text}" if text else ""


def _hung_stacks(procs: list[Any], paths: list[str], running: list[int]) -> str:
    """End the hung ranks with SIGABRT and return their threads' stacks for the message.

    faulthandler writes every thread's stack before the signal ends the rank, so the
    rank's exit is the sign that its stacks are complete.
    """
    for rank in running:
        if procs[rank].is_alive() and procs[rank].pid is not None:
            os.kill(procs[rank].pid, signal.SIGABRT)
    deadline = time.monotonic() + HANG_GUARD
    for rank in running:
        procs[rank].join(max(0.0, deadline - time.monotonic()))
    return "".join(f"\nrank {rank}:" + _stacks(paths[rank]) for rank in running)


def _receive(
    receivers: list[Connection],
    procs: list[Any],
    stack_paths: list[str],
    results: dict[int, tuple[str, Any]],
    until: float,
    *,
    until_error: bool,
) -> None:
    """Take the ranks' results into ``results`` as they come, sleeping in between.

    Returns once every rank has sent, once ``until`` (a ``time.monotonic()`` value) passes,
    or, with ``until_error``, once a rank has failed. A rank whose pipe closes without a
    result died: its entry says so, with its exit code and its threads' stacks.
    """
    waiting = {receivers[r]: r for r in range(len(receivers)) if r not in results}
    while waiting and not (until_error and any(k == "error" for k, _ in results.values())):
        left = until - time.monotonic()
        if left <= 0:
            return
        for ready in wait(list(waiting), timeout=left):
            recv = cast(Connection, ready)
            rank = waiting.pop(recv)
            try:
                results[rank] = recv.recv()
            except EOFError:
                procs[rank].join(HANG_GUARD)  # its pipe closed as it exited: at once
                died = f"rank {rank} died (exit code {procs[rank].exitcode})"
                results[rank] = ("error", (time.time(), died + _stacks(stack_paths[rank])))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results by rank.

    ``fn`` must be importable (a module-level function). Results travel through
    ``torch.save``, so tensors, dicts and lists come back as they were. ``backend`` is gloo
    unless a CUDA test asks for nccl (rank ``r`` then uses GPU ``r`` modulo the GPU count).
    ``fresh=True`` starts each rank in a new interpreter (spawn), which has imported only
    what ``fn``'s module imports: seconds slower, for checks of what a program imports.
    """
    ctx = _FRESH if fresh else _CTX
    for attempt in (1, 2):
        results = _attempt(ctx, fn, world_size, args, timeout, env, backend)
        if attempt == 1 and _only_forming(results):
            # Another job on this host took the port between free_port() and the group's
            # store (its ranks then meet ours): the group did not form, nothing ran.
            print("multirank: the ranks' group did not form; once more, on a new port")
            continue
        break
    errors = {r: payload for r, (kind, payload) in results.items() if kind == "error"}
    if errors:
        raise RankError(_first_failure(errors, world_size))
    if len(results) < world_size:
        missing = [r for r in range(world_size) if r not in results]
        raise RankError(f"ranks {missing} ended without a result")
    return [torch.load(io.BytesIO(results[r][1]), weights_only=False) for r in range(world_size)]


FORMING = "forming"
"""Marks an error raised while the helper's own group formed, before ``fn`` was called."""


def _only_forming(results: dict[int, tuple[str, Any]]) -> bool:
    """Whether no rank ran ``fn`` to its end and the first error came as the group formed."""
    errors = {r: p for r, (kind, p) in results.items() if kind == "error"}
    if not errors or any(kind == "ok" for kind, _ in results.values()):
        return False
    first = min(errors.values(), key=lambda p: p[0])
    return len(first) > 2 and first[2] == FORMING


def _attempt(
    ctx: Any,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout: float,
    env: dict[str, str] | None,
    backend: str,
) -> dict[int, tuple[str, Any]]:
    """One start of the ranks: what each sent (or its death), by rank."""
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    stack_dir = tempfile.mkdtemp(prefix="multirank-")
    stack_paths = [os.path.join(stack_dir, f"rank{rank}.txt") for rank in range(world_size)]
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                fn,
                rank,
                world_size,
                port,
                timeout,
                args,
                env or {},
                backend,
                pipes[rank][1],
                stack_paths[rank],
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    for _, send in pipes:
        send.close()

    deadline = time.monotonic() + timeout
    results: dict[int, tuple[str, Any]] = {}
    receivers = [recv for recv, _ in pipes]
    try:
        _receive(receivers, procs, stack_paths, results, deadline, until_error=True)
        if len(results) < world_size:
            if any(kind == "error" for kind, _ in results.values()):
                # Give the other ranks a moment to report their own errors, then stop.
                grace = time.monotonic() + 5.0
                _receive(receivers, procs, stack_paths, results, grace, until_error=False)
            else:
                running = [r for r in range(world_size) if r not in results]
                raise TimeoutError(
                    f"{fn.__name__} on {world_size} ranks did not finish within {timeout:.0f}s; "
                    f"ranks still running: {running}" + _hung_stacks(procs, stack_paths, running)
                )
    finally:
        for p in procs:
            # A rank still running after the deadline hangs: no point waiting for it.
            p.join(timeout=0 if time.monotonic() > deadline else 5.0)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(stack_dir, ignore_errors=True)
    return results
