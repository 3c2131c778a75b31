"""The watchdog's life: it starts without holding up the wrapper, and ends with it.

Building a wrapper never waits on the store; the watchdog connects on its own thread. On
torch 2.5 and 2.6, where a store built beside a busy thread can abort the process, the
build waits for the watchdog's one try instead.

The watchdog keeps a store connection of its own. Opening one can take seconds: the store's
host looks up each new client's name, and on a name server that drops a query now and then
that lookup waits 5 s, holding every new connection up meanwhile (it made CI hang: ranks
1 and 2 stuck opening it in ``BucketDataParallel.__init__`` while rank 0 waited in the
first broadcast, or had already finished and closed the store). Here the ranks other than
0 reach rank 0's store through a proxy that forwards the process group's own connections
and holds every later one, as such a host does.

The watchdog's thread ends when the last wrapper it watches is done: ``remove_hooks()``
(the Trainer strategy's teardown calls it), the Fabric strategy's teardown, or the wrapper
being collected.
"""

from __future__ import annotations

import gc
import io
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from bucketddp import BucketDataParallel
from bucketddp._compat import store_built_unsafely
from bucketddp.faults import RankFailedError, board, current, monitor
from bucketddp.faults.board import CONNECT_TIMEOUT
from multirank import (
    HANG_GUARD,
    free_port,
    raised,
    run_ranks,
    watchdog_threads,
    watchdog_threads_after_they_end,
)
from store_proxy import HoldingProxy

WORLD = 3
# On torch < 2.7 a wrapper's build waits for the watchdog's one try to connect, and no later
# try is made (the test named in the reason covers that policy).
UNSAFE_SKIP = pytest.mark.skipif(
    store_built_unsafely(),
    reason="this torch builds a TCPStore unsafely beside other threads: "
    "test_where_a_store_built_beside_training_can_abort_it_the_build_waits_for_one_try",
)


def _regroup(rank: int, world: int, port: int, proxy_port: int, hold_after: str) -> None:
    """Replace run_ranks' group by one whose ranks 1.. reach the store through the proxy;
    once it has formed, the proxy holds every new connection (``hold_after`` is made)."""
    dist.destroy_process_group()
    timeout = timedelta(seconds=60)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", port, world, True, timeout, wait_for_workers=False)
    else:
        store = dist.TCPStore("127.0.0.1", proxy_port, world, False, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    dist.barrier()
    if rank == 0:
        Path(hold_after).touch()
    dist.barrier()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _grads_beside_torch_ddp(ours: torch.nn.Module, rank: int) -> list[Any]:
    """Three steps of ``ours`` and of torch DDP on the same batches: their gradients."""
    theirs = DistributedDataParallel(_model())
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(4, 8)
        for model in (ours, theirs):
            model.zero_grad()
            model(x).square().sum().backward()
    return [(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)]


def _train_behind_held_store(rank: int, world: int, *ports_and_flag: Any) -> Any:
    _regroup(rank, world, *ports_and_flag)
    started = time.monotonic()
    ours = BucketDataParallel(_model())
    built_s = time.monotonic() - started
    # The same build again, timed as a reference: the watchdog already runs, so it opens
    # no connection (torch DDP's first build is no reference: it imports for seconds).
    started = time.monotonic()
    BucketDataParallel(_model()).remove_hooks()
    reference_s = time.monotonic() - started
    grads = _grads_beside_torch_ddp(ours, rank)
    # The watchdogs of ranks 1.. dial on their own threads, maybe after the steps above:
    # every rank stays until the proxy holds a connection from each of them.
    _wait_for_held(Path(ports_and_flag[-1]).parent, world - 1)
    dog = current()
    connected = dog is not None and dog.board.wait_connected(0.0)
    return built_s, reference_s, grads, connected


def _train_behind_held_store_on_an_unsafe_torch(rank: int, world: int, *ports_and_flag: Any) -> Any:
    """As on torch < 2.7 (``_compat.store_built_unsafely``), with a short connect timeout."""
    monitor.store_built_unsafely = lambda: True
    board.CONNECT_TIMEOUT = monitor.CONNECT_TIMEOUT = timedelta(seconds=2)
    monitor.CONNECT_SLACK = 1.0
    sys.stderr = said = io.StringIO()  # what the watchdog prints
    _regroup(rank, world, *ports_and_flag)
    started = time.monotonic()
    ours = BucketDataParallel(_model())
    built_s = time.monotonic() - started
    dog = current()
    connected_at_build = dog is not None and dog.board.wait_connected(0.0)
    grads = _grads_beside_torch_ddp(ours, rank)
    time.sleep(3 * monitor.INTERVAL)  # time enough for a second try, were one made
    trying = dog is not None and dog._thread.is_alive() and not dog.board.wait_connected(0.0)
    dist.barrier()
    return built_s, connected_at_build, grads, said.getvalue(), trying


@pytest.mark.compat("watchdog")
def test_where_a_store_built_beside_training_can_abort_it_the_build_waits_for_one_try(
    tmp_path: Path,
) -> None:
    """torch 2.5 and 2.6 register a new TCPStore's Python object without the GIL: one built
    on the watchdog's thread while the main thread makes ``Work`` objects can abort the
    process. There the build waits for the watchdog's first try to connect, and no later
    try is made: on a store that can no longer be reached, that try fails and says so, and
    the watchdog ends."""
    port, flag = free_port(), tmp_path / "hold"
    with HoldingProxy(port, hold_after=flag, release=None, drop=True) as proxy:
        args = (port, proxy.port, str(flag))
        results = run_ranks(
            _train_behind_held_store_on_an_unsafe_torch, WORLD, *args, timeout=2 * HANG_GUARD
        )
    for rank, (built_s, connected_at_build, grads, said, trying) in enumerate(results):
        assert connected_at_build == (rank == 0), (rank, built_s)
        assert not trying, (rank, said)
        if rank:
            assert built_s >= 2.0, (rank, built_s)  # it waited out the failed try
            assert said.count("the watchdog cannot reach the store") == 1, said
            assert "On torch older than 2.7 it tries once" in said, said
        else:
            assert "cannot reach" not in said, said
        for ours, theirs in grads:
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def _wait_for_held(folder: Path, count: int) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while len(list(folder.glob("held-*"))) < count:
        assert time.monotonic() < deadline, f"the proxy never held {count} connections"
        time.sleep(0.05)


@UNSAFE_SKIP
def test_wrappers_are_built_while_the_store_holds_new_connections(tmp_path: Path) -> None:
    port, flag = free_port(), tmp_path / "hold"
    with HoldingProxy(port, hold_after=flag, release=None) as proxy:
        args = (port, proxy.port, str(flag))
        results = run_ranks(_train_behind_held_store, WORLD, *args, timeout=2 * HANG_GUARD)
        # Each watchdog of ranks 1.. asked (again, should its try time out), and waits still.
        assert proxy.held >= WORLD - 1
    for rank, (built_s, reference_s, grads, connected) in enumerate(results):
        # Nothing on the caller's thread waits for the store: a build that waited for the
        # held connection would take CONNECT_TIMEOUT at least, and many times the same build
        # timed just after it (so that a slow machine raises the bound with it).
        bound = max(CONNECT_TIMEOUT.total_seconds(), 20 * reference_s)
        assert built_s < bound, (rank, built_s, reference_s)
        for ours, theirs in grads:
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        assert connected == (rank == 0)


def _wait_for(paths: list[Path]) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"{paths} never came"
        time.sleep(0.05)


def _fail_once_connected(rank: int, world: int, *ports_and_flag: Any) -> str:
    _regroup(rank, world, *ports_and_flag)
    out = Path(ports_and_flag[-1]).parent
    model = BucketDataParallel(_model())
    model(torch.randn(4, 8)).sum().backward()
    # Trained with their watchdogs' connections held: now the proxy lets them through.
    dist.barrier()
    if rank == 0:
        (out / "release").touch()
    dog = current()
    assert dog is not None and dog.board.wait_connected(HANG_GUARD), "it never connected"
    if rank == 2:
        # What the excepthook or the strategy does with an exception that ends training.
        dog.report_exception(ValueError("boom on rank 2"))
        # Still alive until the others were told, so that they are not left to find it gone.
        _wait_for([out / "told0", out / "told1"])
        return "posted"
    message = raised(lambda: time.sleep(10 * HANG_GUARD), RankFailedError)
    (out / f"told{rank}").touch()
    return message


@UNSAFE_SKIP
def test_a_watchdog_that_connected_late_still_names_a_failure(tmp_path: Path) -> None:
    port, flag = free_port(), tmp_path / "hold"
    with HoldingProxy(port, hold_after=flag, release=tmp_path / "release") as proxy:
        args = (port, proxy.port, str(flag))
        messages = run_ranks(_fail_once_connected, WORLD, *args, timeout=2 * HANG_GUARD)
    assert messages[2] == "posted"
    for rank in (0, 1):
        assert "rank 2" in messages[rank] and "boom on rank 2" in messages[rank], messages[rank]


def _lifetimes(rank: int, world: int) -> dict[str, int]:
    out = {}
    first = BucketDataParallel(_model())
    second = BucketDataParallel(_model())
    out["two wrappers"] = watchdog_threads()
    first.remove_hooks()
    out["one released"] = watchdog_threads()
    second.remove_hooks()
    out["both released"] = watchdog_threads()  # stop() joins the thread: no wait
    model = BucketDataParallel(_model())
    model(torch.randn(4, 8)).sum().backward()
    out["new wrapper"] = watchdog_threads()
    del model
    gc.collect()
    out["collected"] = watchdog_threads_after_they_end()  # it notices at its next beat
    dist.barrier()
    return out


def test_the_watchdog_ends_with_the_last_wrapper_it_watches() -> None:
    expected = {
        "two wrappers": 1,
        "one released": 1,
        "both released": 0,
        "new wrapper": 1,
        "collected": 0,
    }
    assert run_ranks(_lifetimes, 2) == [expected, expected]


class _Unused(torch.nn.Module):
    """A layer that never reaches the loss: the reducer's error ends each step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()
        self.idle = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _train_again_after_a_failure(rank: int, world: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # A first run fails on every rank: each reports its own error, as the strategies do.
    first = BucketDataParallel(_Unused())
    dog = current()
    assert dog is not None and dog.board.wait_connected(HANG_GUARD)
    try:
        first(torch.randn(4, 8)).sum().backward()
    except RuntimeError as e:
        dog.report_exception(e)
        out["first"] = str(e)
    dist.barrier()  # the next run's setup; ``first`` stays alive, still watched
    # The second run trains for longer than a peer's failure takes to end a rank.
    second = BucketDataParallel(_model())
    out["new watchdog"] = current() is not dog
    # The same number of steps on every rank (a count by time would differ between them
    # and pair one rank's all-reduce with another's of a different size): 4 s at least.
    steps = 0
    for _ in range(40):
        second(torch.randn(4, 8)).sum().backward()
        steps += 1
        time.sleep(0.1)
    out["steps"] = steps
    # ... and a failure in it is still named.
    if rank == 1:
        dog = current()
        assert dog is not None
        dog.report_exception(ValueError("the second run fails on rank 1"))
        _wait_for([Path(folder) / "told0"])
        return out
    started = time.monotonic()
    out["second"] = raised(lambda: time.sleep(HANG_GUARD), RankFailedError)
    out["told_s"] = time.monotonic() - started
    (Path(folder) / "told0").touch()
    return out


def test_a_run_after_a_failed_one_is_not_ended_by_its_faults(tmp_path: Path) -> None:
    """The store keeps a failed run's fault records; the next wrapper's watchdog must not
    take them for its own run's, and must still name a new failure."""
    results = run_ranks(_train_again_after_a_failure, 2, str(tmp_path), timeout=2 * HANG_GUARD)
    for out in results:
        assert "['idle.weight', 'idle.bias'] received no gradient" in out["first"], out
        assert out["new watchdog"], out
        assert out["steps"] >= 40, out
    assert "rank 1" in results[0]["second"], results[0]
    assert "the second run fails on rank 1" in results[0]["second"], results[0]
    # Named at the second run's own step (its watchdog counts from 1, not on from the first).
    assert "after step 40's forward" in results[0]["second"], results[0]
    assert results[0]["told_s"] < 10.0, results[0]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
