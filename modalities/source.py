"""Open a media source once, so that the allowed-roots check and every later read refer to the same file.

A path checked against the allowed roots and opened again later can be swapped in between: a symlink to a file
outside the roots put in place of the file, or of one of its directories. :func:`open_source` closes that window
the way ``openat2(RESOLVE_NO_SYMLINKS)`` and Go's ``os.Root`` do, with plain ``openat`` calls:

1. resolve the path (``realpath``) and check the resolved path against the roots; ``stat`` it;
2. open that resolved path one component at a time, each relative to its parent directory's descriptor, with
   ``O_NOFOLLOW`` (``O_NOFOLLOW`` alone guards only the last component): a symlink swapped in for the file or for
   any directory on the way fails the open;
3. check that the opened file's ``(st_dev, st_ino)`` are the ones ``stat`` gave in step 1 (a file renamed or
   hard-linked into place is caught too).

The caller then reads only the returned descriptor, through :attr:`OpenedSource.path` (``/proc/self/fd/N``):
opening that name opens the file the descriptor refers to, whatever the original path names by then, and a
decoding child process receives a duplicate of the descriptor (`specstream.modalities.video`). Nothing opens the
original path again.

Errors (`specstream.errors`): `UnreadableSourceError` (missing, outside the allowed roots, a directory, not a
regular file, no permission, over the size limit) and its subclass `SourceChangedError` (``source_changed``: the
path changed between the check and the open).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specstream.errors import SourceChangedError, UnreadableSourceError

_FD_DIR = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
_FD_PATH = re.compile(re.escape(_FD_DIR) + r"/\d+")
_O_DIR = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC  # search-only directory handles
_O_FILE = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY  # NONBLOCK: opening a FIFO must not wait

# Test seam: called with the resolved path after the roots check and before the open, so a test can swap the
# file or a directory in exactly that window. None in normal operation.
_between_check_and_open: Callable[[str], None] | None = None


@dataclass
class OpenedSource:
    """An open, checked media file. Read it through :attr:`path` only; :meth:`close` when done (or ``with``).

    Attributes:
        fd: the descriptor (read-only, close-on-exec).
        name: the path as the caller gave it (for messages).
        real_path: the resolved path that was checked against the roots.
        size: bytes, from ``fstat``.
    """

    fd: int
    name: str
    real_path: str
    size: int

    @property
    def path(self) -> str:
        """``/proc/self/fd/N``: a name for the opened file itself, valid in this process while it is open."""
        return f"{_FD_DIR}/{self.fd}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OpenedSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_source(path: str | os.PathLike, allowed_roots: Sequence[str | os.PathLike] | None = None,
                max_bytes: int | None = None) -> OpenedSource:
    """Open the regular file at ``path`` for reading, once (see the module docstring).

    Args:
        path: a file path (``~`` is expanded).
        allowed_roots: directories the resolved path must lie in; with roots the open follows no symlink created
            after the check. None: any path, symlinks followed (the command line's own inputs).
        max_bytes: size limit (bytes) or None.

    Raises:
        UnreadableSourceError: missing, outside the roots, a directory, not a regular file, no permission, too
            large.
        SourceChangedError: with roots, the path changed between the check and the open.
    """
    name = os.fspath(path)
    p = os.path.expanduser(name)
    real = os.path.realpath(p)
    try:
        checked = os.stat(real)
    except FileNotFoundError:
        raise UnreadableSourceError(f"no such file: {name}") from None
    except PermissionError:
        raise UnreadableSourceError(f"no permission to read: {name}") from None
    except OSError as exc:  # a file where a directory should be, a symlink loop, a name too long
        raise UnreadableSourceError(f"cannot open {name}: {exc.strerror}") from None
    if allowed_roots is not None and not any(_within(real, os.path.realpath(os.fspath(r))) for r in allowed_roots):
        raise UnreadableSourceError(f"{name}: outside the allowed roots")
    if _between_check_and_open is not None:
        _between_check_and_open(real)
    if allowed_roots is None:
        fd = _open_plain(p, name)
    else:
        fd = _open_without_symlinks(real, name)
    try:
        st = os.fstat(fd)
        if allowed_roots is not None and (st.st_dev, st.st_ino) != (checked.st_dev, checked.st_ino):
            raise SourceChangedError(f"{name}: another file was put in its place between the allowed-roots check "
                                     "and the open")
        if stat.S_ISDIR(st.st_mode):
            raise UnreadableSourceError(f"is a directory, not a media file: {name}")
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableSourceError(f"not a regular file: {name}")
        if max_bytes is not None and st.st_size > max_bytes:
            raise UnreadableSourceError(f"{name}: {st.st_size} bytes exceeds the limit of {max_bytes}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return OpenedSource(fd, name, real, st.st_size)


def name_fd_paths(message: str, name: str) -> str:
    """``message`` with every ``/proc/self/fd/N`` (the name an opened source is read by, in this process or a
    decoding child) replaced by ``name``, the source as its sender knows it."""
    return _FD_PATH.sub(lambda _: name, message)


def fd_of_path(path: str) -> int | None:
    """N when ``path`` is ``/proc/self/fd/N`` (an :attr:`OpenedSource.path`), else None."""
    m = _FD_PATH.fullmatch(path)
    return int(path.rsplit("/", 1)[1]) if m else None


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _open_plain(p: str, name: str) -> int:
    try:
        return os.open(p, _O_FILE)
    except FileNotFoundError:
        raise UnreadableSourceError(f"no such file: {name}") from None
    except PermissionError:
        raise UnreadableSourceError(f"no permission to read: {name}") from None
    except OSError as exc:
        raise UnreadableSourceError(f"cannot open {name}: {exc.strerror}") from None


def _open_without_symlinks(real: str, name: str) -> int:
    """Open the resolved path ``real`` walking from ``/`` with one ``openat(..., O_NOFOLLOW)`` per component."""
    parts = [c for c in real.split(os.sep) if c]
    if not parts:
        raise UnreadableSourceError(f"is a directory, not a media file: {name}")
    dirfd = os.open(os.sep, _O_DIR)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                fd = os.open(part, (_O_FILE if last else _O_DIR) | os.O_NOFOLLOW, dir_fd=dirfd)
            except PermissionError:
                raise UnreadableSourceError(f"no permission to read: {name}") from None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                    where = "the file" if last else "one of its directories"
                    raise SourceChangedError(f"{name}: {where} changed between the allowed-roots check and the "
                                             f"open ({os.strerror(exc.errno)})") from None
                raise UnreadableSourceError(f"cannot open {name}: {os.strerror(exc.errno)}") from None
            os.close(dirfd)
            dirfd = fd
        fd, dirfd = dirfd, -1
        return fd
    finally:
        if dirfd >= 0:
            os.close(dirfd)
