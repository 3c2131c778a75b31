"""The job's snapshot key, agreed through a real TCPStore by each node's first rank: a node
that kept the key wins over one that has none (a node joining a running job), whichever
asks first, so the joining node never hides the others' snapshots."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.distributed as dist

from bucketddp.elastic import secret
from bucketddp.elastic.folder import Folder
from bucketddp.elastic.job import Job

KEPT = "ab" * 32


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> dist.TCPStore:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setattr(
        secret,
        "_store",
        lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False),
    )
    return server


def _node(tmp_path: Path, node: int, nodes: int | None, kept: str | None) -> tuple[Job, Folder]:
    folder = Folder.open(tmp_path / f"node{node}" / "bucketddp-test" / "job", private=2)
    if kept is not None:
        folder.write(secret.KEY_FILE, kept.encode("ascii"))
    return Job("job", 0, node, node, 2, 0, 1, nodes=nodes), folder


def _agree(nodes: list[tuple[Job, Folder]]) -> list[bytes]:
    # The node without a copy asks first: it must still wait for the one that has it.
    with ThreadPoolExecutor(len(nodes)) as pool:
        return list(pool.map(lambda n: secret.job_key(*n), reversed(nodes)))[::-1]


def test_a_joining_node_takes_the_kept_key(store: dist.TCPStore, tmp_path: Path) -> None:
    nodes = [_node(tmp_path, 0, 2, KEPT), _node(tmp_path, 1, 2, None)]
    assert _agree(nodes) == [bytes.fromhex(KEPT)] * 2
    assert nodes[1][1].read(secret.KEY_FILE).decode() == KEPT  # the joining node keeps it


def test_nodes_with_no_kept_key_agree_on_a_new_one(store: dist.TCPStore, tmp_path: Path) -> None:
    first, second = _agree([_node(tmp_path, 0, 2, None), _node(tmp_path, 1, 2, None)])
    assert first == second and first != bytes.fromhex(KEPT) and len(first) == 32


def test_a_node_that_never_offers_is_named(
    store: dist.TCPStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(secret, "POST_TIMEOUT", secret.timedelta(seconds=1))
    with pytest.raises(RuntimeError, match=r"node\(s\) \[1\] did not offer"):
        secret.job_key(*_node(tmp_path, 0, 2, KEPT))
