"""The private folder's checks (``bucketddp.elastic.folder``) and the meta format's
(``bucketddp.elastic.files``), in one process.

A folder is made ``0700`` and its files ``0600`` whatever the umask; a symlink, a folder
with group or other bits, and a symlinked file are refused. A meta is read back only with
the key it was written with, and only whole, with every field. A file copied to another
folder (a stop's snapshot going to disk) arrives whole, private, and never through a
symlink. Pruning a folder's snapshots leaves its other files, written or being
written (another rank's exit mark).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bucketddp.elastic.files import BadMeta, decode_meta, encode_meta, remove_except, tables
from bucketddp.elastic.folder import Folder, UnsafeFolder
from bucketddp.skeleton import TensorMeta

KEY = bytes(range(32))


@pytest.fixture
def umask0() -> Iterator[None]:
    old = os.umask(0)
    yield
    os.umask(old)


def test_made_private_whatever_the_umask(tmp_path: Path, umask0: None) -> None:
    folder = Folder.open(tmp_path / "root" / "parent" / "run", private=2)
    folder.write("meta", b"x")
    folder.map("data", 64, create=True)
    for path in (tmp_path / "root" / "parent", folder.path):
        assert path.stat().st_mode & 0o777 == 0o700, path
    for name in ("meta", "data"):
        assert (folder.path / name).stat().st_mode & 0o777 == 0o600, name
    folder.remove_all()
    assert not folder.path.exists()


def test_a_symlink_or_an_open_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeFolder, match="is a symlink"):
        Folder.open(tmp_path / "link")
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o770)
    with pytest.raises(UnsafeFolder, match=r"mode 0770\); make it private \(chmod 700"):
        Folder.open(tmp_path / "open" / "run", private=2)
    assert not (tmp_path / "open" / "run").exists()  # nothing made inside
    folder = Folder.open(tmp_path / "mine")
    (folder.path / "planted").symlink_to(tmp_path / "elsewhere" / "target")
    with pytest.raises(OSError):
        folder.read("planted")


def _payload() -> dict[str, object]:
    fields = "format step phase attempt node local_rank local_world_size rank world_size nbytes"
    payload: dict[str, object] = {f: 1 for f in fields.split()}
    return {**payload, "checksum": -5, "owners": [], "offsets": [], "metas": []} | {
        "finished": True,
        "skeleton": b"skeleton",
        "own": b"own",
    }


def test_a_copy_arrives_whole_and_private(tmp_path: Path, umask0: None) -> None:
    shm, disk = Folder.open(tmp_path / "shm"), Folder.open(tmp_path / "disk")
    data = os.urandom(3 * 1024 * 1024 + 5)
    shm.write("a0.n0.l0.s1.data", data)
    disk.copy_in(shm, "a0.n0.l0.s1.data")
    assert disk.read("a0.n0.l0.s1.data") == data
    assert disk.names() == ["a0.n0.l0.s1.data"]  # no temporary file left
    assert (tmp_path / "disk" / "a0.n0.l0.s1.data").stat().st_mode & 0o777 == 0o600
    os.symlink(tmp_path / "shm" / "a0.n0.l0.s1.data", tmp_path / "shm" / "link")
    with pytest.raises(OSError):
        disk.copy_in(shm, "link")
    assert disk.names() == ["a0.n0.l0.s1.data"]


def test_a_meta_reads_back_only_whole_with_its_key() -> None:
    raw = encode_meta(_payload(), KEY)
    got = decode_meta(raw, KEY)
    assert got == _payload()
    with pytest.raises(BadMeta, match="tag does not check"):
        decode_meta(raw, bytes(32))
    with pytest.raises(BadMeta, match="tag does not check"):
        decode_meta(raw[:-1], KEY)
    with pytest.raises(BadMeta, match="cut short"):
        decode_meta(raw[:20], KEY)
    short = _payload()
    del short["step"]
    with pytest.raises(BadMeta, match="'step' is missing"):
        decode_meta(encode_meta(short, KEY), KEY)
    unflagged = _payload() | {"finished": 1}  # a flag must be a boolean
    with pytest.raises(BadMeta, match="'finished' is missing or not a boolean"):
        decode_meta(encode_meta(unflagged, KEY), KEY)
    no_section = _payload()
    del no_section["own"]
    with pytest.raises(BadMeta, match="'own' is missing"):
        decode_meta(encode_meta(no_section, KEY), KEY)


def test_a_meta_with_kept_tables_reads_back_as_one_made_afresh() -> None:
    metas = [
        TensorMeta(torch.float32, (3, 4), True, True),
        TensorMeta(torch.bfloat16, (), False, False),
        TensorMeta(torch.int64, (0,), False, False),
    ]
    payload = _payload() | {"metas": metas, "owners": [0, 1, 0], "offsets": [0, 0, 64]}
    fresh = decode_meta(encode_meta(payload, KEY), KEY)
    assert fresh == payload
    kept = payload | {"tables": tables(payload)}
    assert decode_meta(encode_meta(kept, KEY), KEY) == fresh


def test_pruning_snapshots_leaves_other_files_even_mid_write(tmp_path: Path) -> None:
    """A rank keeping only the fit's end removed another rank's exit mark while its write
    (a temporary file, then a rename) was in flight: no rank then saw every mark, and the
    node's snapshots stayed in /dev/shm after a clean exit."""
    folder = Folder.open(tmp_path / "run")
    snapshots = ["a0.n0.l0.s0.meta", "a0.n0.l0.s0.data", "a0.n0.l0.s1.meta", "a0.n0.l0.s1.data"]
    others = ["key", "exited.a0.n0.l0", "exited.a0.n0.l1.4242.tmp"]
    for name in [*snapshots, "a0.n0.l1.s1.meta.4243.tmp", *others]:
        folder.write(name, b"x")
    remove_except(folder, ["a0.n0.l0.s0.meta"])
    assert sorted(folder.names()) == sorted([*snapshots[:2], *others])
