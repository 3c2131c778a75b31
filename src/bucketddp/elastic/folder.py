"""A private folder: made ``0700``, checked before use, its files opened only through it.

Snapshots hold the model, and a snapshot's meta holds pickled state, so no other user may
read the folder or put a file in it. ``Folder.open`` creates the folder's private part
with mode ``0700`` (the mode is given at creation: a umask can only narrow it), then opens
each of its levels without following a symlink and checks the open folder itself: a
directory, owned by this process's user, with no group or other permission bits. Anything
else raises ``UnsafeFolder``, naming the folder, its owner and mode, and the fix.

Every file is then opened relative to the open folder (``dir_fd``), never through a
symlink, and must be a regular file of this user: a folder renamed or replaced after the
check is not the one used. New files get mode ``0600`` at creation.

Nothing here knows what the files hold (``files.py``); a disk folder can be checked the
same way (``Folder.open(path)``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pwd
import shutil
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a planted FIFO never blocks
OPEN_TRIES = 3
COPY_CHUNK = 16 << 20  # bytes per read and write of ``Folder.copy_in``


class UnsafeFolder(RuntimeError):
    """A folder that another user could read or write, or that is not this user's."""


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _problem(path: Path, st: os.stat_result) -> str | None:
    """Why the folder ``st`` describes is not a private one of this user's, or None."""
    me = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    found = f"owner {_owner(st.st_uid)}, mode {mode:04o}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory ({found}); remove it or use another folder"
    if st.st_uid != me:
        return (
            f"{path} belongs to another user ({found}), not to {_owner(me)}: nothing in it "
            "is read. Its owner or root can remove it; or use another folder"
        )
    if mode & 0o077:
        return (
            f"{path} can be read or written by other users ({found}); "
            f"make it private (chmod 700 {path}) or use another folder"
        )
    return None


def _open_private(parent: int, name: str, path: Path) -> int:
    """Create ``name`` in the open folder ``parent`` (mode 0700) if missing, open it without
    following a symlink, and check it; the open folder's descriptor."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as e:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeFolder(
                f"{path} is a symlink (owner {_owner(st.st_uid)}): nothing is read through "
                "it. Remove it, or use another folder"
            ) from e
        raise UnsafeFolder(_problem(path, st) or f"{path} cannot be opened: {e}") from e
    problem = _problem(path, os.fstat(fd))
    if problem is not None:
        os.close(fd)
        raise UnsafeFolder(problem)
    return fd


class Folder:
    """An open private folder (see the module docstring); its files by name."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def open(cls, path: Path, private: int = 1) -> Folder:
        """Open ``path``, whose last ``private`` levels are made (``0700``) if missing and
        must each be a private folder of this user's; the levels above are made if missing
        and followed as they are (``/dev/shm`` is everyone's). Raises ``UnsafeFolder``."""
        if not 1 <= private <= len(path.parts) - 1:
            raise ValueError(f"private must name between 1 and all levels of {path}")
        for _ in range(OPEN_TRIES - 1):
            # An empty level may be removed between its open and the next level's making
            # (another job of this user's ending: ``remove_all(parents=1)``): open again.
            with contextlib.suppress(FileNotFoundError):
                return cls._open(path, private)
        return cls._open(path, private)

    @classmethod
    def _open(cls, path: Path, private: int) -> Folder:
        base = Path(*path.parts[: len(path.parts) - private])
        base.mkdir(parents=True, exist_ok=True)
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in path.parts[len(path.parts) - private :]:
                base = base / name
                inner = _open_private(fd, name, base)
                os.close(fd)
                fd = inner
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def names(self) -> list[str]:
        """The names in the folder."""
        return os.listdir(self._fd)

    def _open_file(self, name: str, flags: int, mode: int = 0o600) -> int:
        fd = os.open(name, flags | _FILE_FLAGS, mode, dir_fd=self._fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise OSError(f"{self.path / name} is not a regular file of this user's")
        return fd

    def read(self, name: str) -> bytes:
        """The whole of file ``name`` (``OSError`` if it is missing or not ours)."""
        fd = self._open_file(name, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def write(self, name: str, data: bytes, *, sync: bool = False) -> None:
        """Write ``name`` whole or not at all: a new file (``0600``), then a rename; with
        ``sync``, the file and then the rename reach the disk before this returns.

        The new file's name is this process's own: ranks of two agents on one host share
        the folder and may write the same name at once."""
        tmp = f"{name}.{os.getpid()}.tmp"
        self.remove(tmp)
        fd = self._open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        if sync:
            os.fsync(self._fd)

    def copy_in(self, source: Folder, name: str) -> None:
        """Copy file ``name`` of ``source`` here, whole or not at all and synced to disk
        (as ``write(..., sync=True)``), in chunks: a snapshot's data may be gigabytes."""
        tmp = f"{name}.{os.getpid()}.tmp"
        self.remove(tmp)
        src = source._open_file(name, os.O_RDONLY)
        try:
            dst = self._open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            with os.fdopen(dst, "wb") as out, os.fdopen(src, "rb", closefd=False) as inp:
                shutil.copyfileobj(inp, out, COPY_CHUNK)
                out.flush()
                os.fsync(out.fileno())
        finally:
            os.close(src)
        os.replace(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        os.fsync(self._fd)

    def map(self, name: str, nbytes: int, *, create: bool) -> mmap.mmap | None:
        """File ``name`` mapped: with ``create``, made (``0600``) or resized to ``nbytes``
        and mapped shared, for writing; else a private copy-on-write mapping of its first
        ``nbytes`` (``OSError`` if it is shorter). None for ``nbytes == 0``."""
        flags = os.O_RDWR | os.O_CREAT if create else os.O_RDONLY
        fd = self._open_file(name, flags)
        try:
            if create:
                os.ftruncate(fd, nbytes)
                if nbytes:
                    # Its pages now, so that a full tmpfs is an ENOSPC here, not a SIGBUS
                    # at the first write into the mapping.
                    os.posix_fallocate(fd, 0, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                raise OSError(f"{self.path / name} is shorter than {nbytes} bytes")
            if nbytes == 0:
                return None
            access = mmap.ACCESS_WRITE if create else mmap.ACCESS_COPY
            return mmap.mmap(fd, nbytes, access=access)
        finally:
            os.close(fd)

    def remove(self, name: str) -> None:
        """Remove file ``name`` if it exists."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._fd)

    def _stats(self) -> list[os.stat_result]:
        out = []
        for name in self.names():
            with contextlib.suppress(OSError):
                out.append(os.stat(name, dir_fd=self._fd, follow_symlinks=False))
        return out

    def bytes_held(self) -> int:
        """The bytes the folder's files take."""
        return sum(st.st_blocks * 512 for st in self._stats())

    def last_change(self) -> float | None:
        """When a file in the folder last changed (a time in seconds); None if it is empty."""
        return max((st.st_mtime for st in self._stats()), default=None)

    def remove_all(self, parents: int = 0) -> int:
        """Remove every file in the folder, then the folder if it is left empty, then up to
        ``parents`` levels above it, each if it is left empty; the number of files removed."""
        removed = 0
        for name in self.names():
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self._fd)
                removed += 1
        for level in [self.path, *self.path.parents[:parents]]:
            try:
                os.rmdir(level)
            except OSError:
                break
        return removed

    def close(self) -> None:
        """Close the folder (its files stay)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()
