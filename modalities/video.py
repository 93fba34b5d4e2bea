"""Video input: proxy frames with PTS timestamps, and full-resolution re-decoding of chosen frames.

All decoding runs in a child process (see `_video_worker`): decord, the primary backend, can hang in native code
holding the GIL, and only a process can be killed. The parent streams frames back over a pipe and kills the
child when no message arrives within ``stall_timeout_s``.

Backends: decord first, when it can be trusted on the file (no rotation, its frame count and timestamps agree
with a PyAV demux of the packets, the header's frame count agrees with the packets); PyAV otherwise, and PyAV
takes over from the next frame when decord fails or stalls part-way.

Terms: *proxy frame* — a small RGB copy (longer side ``proxy_long_side`` px) used for scene scoring; *PTS* —
presentation timestamp of the container. ``timestamp_s = (pts - start_pts) * time_base`` (exact integer
arithmetic, correctly rounded), never ``index / fps``, so variable-frame-rate video gets true times.
``frame_index`` counts decoded frames in PTS order from 0.

Child processes start from a forkserver (Linux) that preloads the worker module, so each video costs a fork,
not an interpreter start. As with any `multiprocessing` user, a script calling this module must guard its entry
point with ``if __name__ == "__main__":`` (the console script ``specstream`` does).

Errors (`specstream.errors`): `UnreadableSourceError` (missing, directory, empty), `UnsupportedMediaError`
(not a container we decode), `NoVideoStreamError` (audio-only), `CorruptMediaError` (damaged; frames decoded
before the damage have already been yielded), `DecodeTimeoutError` (no progress within ``stall_timeout_s``);
and `MissingDependencyError` when PyAV is not installed (``pip install 'specstream[video]'``).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from specstream.errors import (
    CorruptMediaError,
    DecodeTimeoutError,
    MissingDependencyError,
    NoVideoStreamError,
    SpecstreamError,
    UnreadableSourceError,
    UnsupportedMediaError,
)

Backend = Literal["auto", "decord", "pyav"]

VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mkv", ".webm", ".mov", ".avi", ".gif"})
DEFAULT_PROXY_LONG_SIDE = 64
DEFAULT_STALL_TIMEOUT_S = 30.0

_ERRORS: dict[str, type[SpecstreamError]] = {
    cls.code: cls
    for cls in (UnreadableSourceError, UnsupportedMediaError, NoVideoStreamError, CorruptMediaError,
                DecodeTimeoutError, MissingDependencyError)
}
_WORKER = "specstream.modalities._video_worker"
_ctx_lock = threading.Lock()
_ctx = None


class _DecoderDied(CorruptMediaError):
    """The child process ended without a word (a native crash): reported as ``corrupt_media``."""


@dataclass(frozen=True)
class VideoInfo:
    """The video stream as probed. Sizes in pixels, after rotation (display orientation)."""

    path: str
    width: int
    height: int
    rotation: int  # degrees counter-clockwise applied for display, multiple of 90
    time_base: tuple[int, int]  # (numerator, denominator): seconds per PTS tick
    start_pts: int | None  # PTS of the stream start (timestamps are relative to it); None: first frame's PTS
    duration_s: float | None  # from the container header; None when unknown
    header_frames: int  # frame count the header states; 0 when unknown
    codec: str  # decoder name, e.g. "h264"
    container: str  # demuxer name, e.g. "mov,mp4,m4a,3gp,3g2,mj2"


@dataclass(frozen=True)
class ProxyFrame:
    """One decoded frame, scaled down for scoring."""

    frame_index: int  # count of decoded frames before this one, in PTS order
    timestamp_s: float  # presentation time in seconds, from PTS (see module docstring)
    pts: int  # raw PTS in ``VideoInfo.time_base`` ticks
    image: np.ndarray  # [h, w, 3] uint8 RGB, display orientation, longer side = proxy_long_side


def _mp_context():
    """A multiprocessing context whose children start fast: forkserver (Linux) with the worker preloaded."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            if sys.platform.startswith("linux"):
                _ctx = multiprocessing.get_context("forkserver")
                preload = [_WORKER, "numpy", "av"]
                if importlib.util.find_spec("decord") is not None:
                    preload.append("decord")
                _ctx.set_forkserver_preload(preload)
            else:
                _ctx = multiprocessing.get_context("spawn")
        return _ctx


class _InheritedFd:
    """An opened source's ``/proc/self/fd/N`` (`specstream.modalities.source`) on its way to a decoding child.

    Pickled for the child as a duplicate of descriptor N (multiprocessing's ``DupFd``: the forkserver hands the
    descriptor over as ``subprocess``'s ``pass_fds`` would) and rebuilt there as the child's own
    ``/proc/self/fd/M``, so the child reads the very file this process opened and never opens its path."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        from specstream.modalities import _video_worker

        return _video_worker.inherited_fd_path, (DupFd(self.fd),)


def _for_child(path: str):
    """The path argument of a child process: a descriptor name of this process crosses as the descriptor."""
    from specstream.modalities.source import fd_of_path

    fd = fd_of_path(path)
    return path if fd is None else _InheritedFd(fd)


def _raise(code: str, message: str):
    raise _ERRORS.get(code, CorruptMediaError)(message)


def _check_path(path: str | os.PathLike) -> str:
    """The path, after checking it exists and that its container header is within the media limits
    (`specstream.modalities.limits.check_video_file`: nothing is decoded)."""
    from specstream.modalities.limits import check_video_file

    p = os.fspath(path)
    if not os.path.exists(p):
        raise UnreadableSourceError(f"no such file: {p}")
    check_video_file(p)
    return p


class VideoDecodeSession:
    """One decoding child process for one video: stream proxy frames, then decode chosen frames at full size.

    Usage::

        with VideoDecodeSession(path) as s:
            for f in s.proxy_frames():      # ProxyFrame, in PTS order
                ...
            images = s.decode_full([f.timestamp_s for f in chosen])   # list of [H, W, 3] uint8

    ``path`` may be an opened source's ``/proc/self/fd/N`` (`specstream.modalities.source`): the child then
    receives a duplicate of that descriptor and never opens a path (the same holds for `decode_frames`).
    ``backend``: "auto" (decord when trusted, else PyAV), "decord" (fail when it cannot be used) or "pyav".
    ``stall_timeout_s``: seconds without any progress before the child is killed (`DecodeTimeoutError`; with
    "auto" a stalled decord is first replaced by PyAV resuming after the frames already delivered).
    ``backend_used`` and ``backend_notes`` record which backends ran and why.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        proxy_long_side: int = DEFAULT_PROXY_LONG_SIDE,
        backend: Backend = "auto",
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    ):
        if proxy_long_side < 2:
            raise ValueError(f"proxy_long_side must be >= 2, got {proxy_long_side}")
        if backend not in ("auto", "decord", "pyav"):
            raise ValueError(f"backend must be auto, decord or pyav, got {backend!r}")
        self.path = os.fspath(path)
        self.proxy_long_side = proxy_long_side
        self.backend = backend
        self.stall_timeout_s = stall_timeout_s
        self.info: VideoInfo | None = None
        self.backend_used: str | None = None
        self.backend_notes: list[str] = []
        self.frames_decoded = 0
        self._proc = None
        self._conn = None
        self._ended = False

    # -- process management -------------------------------------------------------------------------------
    def _start(self, backend: str, skip: int) -> None:
        from specstream.modalities import _video_worker

        ctx = _mp_context()
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=_video_worker.proxy_session,
            args=(child, _for_child(self.path), self.proxy_long_side, backend, skip),
            daemon=True,
            name=f"specstream-decode:{os.path.basename(self.path)}",
        )
        self._proc.start()
        child.close()
        self._conn = parent

    def _kill(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        proc, self._proc = self._proc, None
        if proc is not None and proc.pid is not None:  # pid is None when start() itself failed
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)

    def _recv(self, what: str):
        """Next message from the child; raises DecodeTimeoutError after ``stall_timeout_s`` of silence."""
        assert self._conn is not None
        try:
            if not self._conn.poll(self.stall_timeout_s):
                raise DecodeTimeoutError(
                    f"no progress for {self.stall_timeout_s:g} s while {what} ({self.path}); decoder killed"
                )
            return self._conn.recv()
        except (EOFError, OSError):  # the pipe closed, possibly in the middle of a message
            if self._proc is not None:
                self._proc.join(timeout=5)
            code = self._proc.exitcode if self._proc is not None else None
            raise _DecoderDied(f"decoder process died (exit code {code}) while {what} ({self.path})") from None

    def close(self) -> None:
        """Stop the child process (idempotent)."""
        if self._conn is not None and self._ended:
            try:
                self._conn.send(("close",))
            except (OSError, BrokenPipeError):
                pass
        self._kill()

    def __enter__(self) -> VideoDecodeSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self._kill()
        except Exception:
            pass

    # -- decoding -------------------------------------------------------------------------------------------
    def proxy_frames(self) -> Iterator[ProxyFrame]:
        """Yield every frame as a `ProxyFrame`, in PTS order. Call once per session.

        Raises the `MediaError` subclasses of the module docstring; a damaged file first yields the frames
        decoded before the damage. Closing the generator early stops the child.
        """
        from specstream.modalities.limits import check_stream

        _check_path(self.path)
        backend = self.backend
        delivered = 0
        try:
            while True:
                self._start(backend, delivered)
                try:
                    while True:
                        msg = self._recv("decoding proxy frames")
                        kind = msg[0]
                        if kind == "info":
                            d = msg[1]
                            check_stream(d["width"], d["height"], f"{self.path} (video stream)")
                            self.info = VideoInfo(
                                path=self.path, width=d["width"], height=d["height"], rotation=d["rotation"],
                                time_base=(d["tb_num"], d["tb_den"]), start_pts=d["start_pts"],
                                duration_s=d["duration_s"], header_frames=d["header_frames"], codec=d["codec"],
                                container=d["container"],
                            )
                        elif kind == "backend":
                            self.backend_used = msg[1]
                            self.backend_notes.append(f"{msg[1]}: {msg[2]}")
                        elif kind == "frames":
                            for idx, pts, ts, img in msg[1]:
                                delivered = idx + 1
                                self.frames_decoded = delivered
                                yield ProxyFrame(frame_index=idx, timestamp_s=ts, pts=pts, image=img)
                        elif kind == "end":
                            self._ended = True
                            return
                        elif kind == "error":
                            _raise(msg[1], msg[2])
                except (DecodeTimeoutError, _DecoderDied) as exc:
                    self._kill()
                    if backend == "auto" and self.backend_used == "decord":
                        # decord hung or crashed in native code: PyAV resumes after the frames delivered.
                        self.backend_notes.append(f"decord failed: {exc.message}")
                        backend = "pyav"
                        continue
                    raise
        finally:
            if not self._ended:
                self._kill()

    def decode_full(self, timestamps_s: Sequence[float]) -> list[np.ndarray]:
        """Decode the frames presented at ``timestamps_s`` (seconds, as in `ProxyFrame.timestamp_s`) at full
        resolution. Returns one ``[H, W, 3]`` uint8 RGB array (display orientation) per distinct timestamp, in
        ascending time order. Each target gets the first frame with timestamp >= target - 1 us.

        Only after `proxy_frames` finished (the same child serves it); raises `MediaError` subclasses.
        """
        if not self._ended or self._conn is None:
            raise RuntimeError("decode_full() needs a finished proxy_frames() pass on this session")
        self._conn.send(("decode", [float(t) for t in timestamps_s]))
        msg = self._recv("decoding full-resolution frames")
        if msg[0] == "error":
            self._ended = False
            self._kill()
            _raise(msg[1], msg[2])
        return [img for _, img in msg[1]]

    def iter_full(self, timestamps_s: Sequence[float]) -> Iterator[np.ndarray]:
        """:meth:`decode_full` one frame at a time: the child blocks on the pipe until each frame is taken, so
        a slow consumer holds back the decoding instead of receiving every frame at once. Same order, errors
        and preconditions as :meth:`decode_full`; frames yielded before an error stand."""
        if not self._ended or self._conn is None:
            raise RuntimeError("iter_full() needs a finished proxy_frames() pass on this session")
        self._conn.send(("decode_stream", [float(t) for t in timestamps_s]))
        while True:
            msg = self._recv("decoding full-resolution frames")
            if msg[0] == "full_frame":
                try:
                    yield msg[2]
                except GeneratorExit:  # abandoned mid-stream: the child is still sending, it cannot serve again
                    self._ended = False
                    self._kill()
                    raise
            elif msg[0] == "full_end":
                return
            else:
                self._ended = False
                self._kill()
                if msg[0] == "error":
                    _raise(msg[1], msg[2])
                raise CorruptMediaError(f"unexpected message {msg[0]!r} from the decoder of {self.path}")


def iter_proxy_frames(
    path: str | os.PathLike,
    *,
    proxy_long_side: int = DEFAULT_PROXY_LONG_SIDE,
    backend: Backend = "auto",
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
) -> Iterator[ProxyFrame]:
    """Yield the proxy frames of ``path`` (see `VideoDecodeSession.proxy_frames`); the child stops at the end."""
    with VideoDecodeSession(
        path, proxy_long_side=proxy_long_side, backend=backend, stall_timeout_s=stall_timeout_s
    ) as session:
        yield from session.proxy_frames()


def decode_frames(
    path: str | os.PathLike,
    timestamps_s: Sequence[float],
    *,
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
) -> list[np.ndarray]:
    """Decode the frames of ``path`` presented at ``timestamps_s`` at full resolution, in a child process.

    Returns ``[H, W, 3]`` uint8 RGB arrays (display orientation), one per distinct timestamp, ascending. Each
    target gets the first frame with timestamp >= target - 1 us (so pass `ProxyFrame.timestamp_s` values).
    Raises the `MediaError` subclasses of the module docstring.
    """
    from specstream.modalities import _video_worker

    p = _check_path(path)
    ctx = _mp_context()
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_video_worker.full_session,
                       args=(child, _for_child(p), [float(t) for t in timestamps_s]),
                       daemon=True)
    proc.start()
    child.close()
    try:
        while True:
            if not parent.poll(stall_timeout_s):
                raise DecodeTimeoutError(f"no progress for {stall_timeout_s:g} s decoding frames of {p}")
            try:
                msg = parent.recv()
            except EOFError:
                raise CorruptMediaError(f"decoder process died (exit code {proc.exitcode}) on {p}") from None
            if msg[0] == "error":
                _raise(msg[1], msg[2])
            if msg[0] == "full":
                return [img for _, img in msg[1]]
    finally:
        parent.close()
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=5)


def probe_video(path: str | os.PathLike, *, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> VideoInfo:
    """Probe ``path`` (in a child process) without decoding more than its first frame. Raises `MediaError`."""
    with VideoDecodeSession(path, backend="pyav", stall_timeout_s=stall_timeout_s) as s:
        gen = s.proxy_frames()
        try:
            next(gen, None)
        finally:
            gen.close()
        assert s.info is not None
        return s.info


def is_video_path(path: str | os.PathLike) -> bool:
    """True when the file name has a video extension (mp4, m4v, mkv, webm, mov, avi, gif)."""
    return os.path.splitext(os.fspath(path))[1].lower() in VIDEO_EXTENSIONS
