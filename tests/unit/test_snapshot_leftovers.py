"""``python -m bucketddp.snapshots``: lists and removes this user's job folders, and nothing
else (``bucketddp.elastic.leftovers``).

Job folders are made as training makes them (``Folder.open``) under a root of the test's
own. A name that is not one of the user's job folders, and a symlink planted among them,
are refused and what they point at is left alone; a folder whose file another process has
mapped (as a running worker does) is kept unless ``--force``; the per-user folder goes
with its last job folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bucketddp.elastic.folder import Folder
from bucketddp.elastic.leftovers import main
from lightning_runs import ROOT


def _job(root: Path, run: str, nbytes: int = 4096) -> Folder:
    folder = Folder.open(root / f"bucketddp-{os.geteuid()}" / run, private=2)
    folder.write("key", b"k" * 64)
    folder.map("a0.n0.l0.s0.data", nbytes, create=True)
    return folder


def _cli(root: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["--root", str(root), *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_lists_and_removes_only_the_named_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = tmp_path / f"bucketddp-{os.geteuid()}"
    assert _cli(tmp_path, "list", capsys=capsys) == (0, f"no snapshots under {parent}\n")
    _job(tmp_path, "run-a", 1 << 20)
    _job(tmp_path, "run-b")
    code, text = _cli(tmp_path, "list", capsys=capsys)
    assert code == 0
    lines = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert set(lines) == {"run-a", "run-b"}, text
    assert "1.0 MiB" in lines["run-a"] and " 2 " in lines["run-a"], text
    for bad in ("../run-a", "run-c", "run-a/key"):
        code, text = _cli(tmp_path, "remove", bad, capsys=capsys)
        assert code == 1 and "holds no job folder" in text, text
    assert (parent / "run-a" / "key").exists()
    code, text = _cli(tmp_path, "remove", "run-a", capsys=capsys)
    assert (code, text) == (0, "run-a: removed (2 files)\n")
    assert sorted(p.name for p in parent.iterdir()) == ["run-b"]
    assert _cli(tmp_path, "remove", "--all", capsys=capsys)[0] == 0
    assert not parent.exists()  # the per-user folder went with its last job folder
    assert tmp_path.exists()


def test_a_planted_symlink_is_not_followed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _job(tmp_path, "run-a")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (elsewhere / "precious").write_text("keep")
    (tmp_path / f"bucketddp-{os.geteuid()}" / "evil").symlink_to(elsewhere)
    code, text = _cli(tmp_path, "list", capsys=capsys)
    assert code == 0 and "evil" in text and "not read" in text and "symlink" in text, text
    code, text = _cli(tmp_path, "remove", "evil", capsys=capsys)
    assert code == 1 and "not removed" in text and "symlink" in text, text
    code, text = _cli(tmp_path, "remove", "--all", capsys=capsys)
    assert code == 0 and "run-a: removed" in text and "evil" not in text, text
    assert (elsewhere / "precious").read_text() == "keep"


def test_a_folder_another_process_maps_is_kept_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _job(tmp_path, "running")
    data = folder.path / "a0.n0.l0.s0.data"
    mapper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import mmap, sys\n"
            f"f = open({str(data)!r}, 'r+b'); m = mmap.mmap(f.fileno(), 4096)\n"
            "print('mapped', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert mapper.stdout is not None and mapper.stdout.readline() == "mapped\n"
        code, text = _cli(tmp_path, "list", capsys=capsys)
        assert f"pid {mapper.pid}" in text, text
        for args in (["running"], ["--all"]):
            code, text = _cli(tmp_path, "remove", *args, capsys=capsys)
            assert f"kept, in use by pid {mapper.pid}" in text, text
            assert data.exists()
        code, text = _cli(tmp_path, "remove", "--force", "running", capsys=capsys)
        assert code == 0 and "running: removed" in text, text
        assert not folder.path.exists()
    finally:
        mapper.kill()
        mapper.wait()
