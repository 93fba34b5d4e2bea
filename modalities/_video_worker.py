"""The decoding side of `specstream.modalities.video`: runs in a child process, never in the caller's process.

Why a child process: decord can hang in native code while holding the GIL (seen on files whose header overstates
the frame count), and no thread can be timed out then. The parent (`video.VideoDecodeSession`) reads messages
from a `multiprocessing` connection with a stall timeout and kills this process when it stops making progress.

Protocol (child -> parent), each message a tuple whose first item names it:

- ``("info", dict)``: what the probe found (see `video.VideoInfo`).
- ``("backend", name, reason)``: the backend now decoding (``"decord"`` or ``"pyav"``) and why it was chosen.
- ``("frames", [(frame_index, pts, timestamp_s, image), ...])``: proxy frames in PTS order; ``image`` is
  ``[h, w, 3]`` uint8 RGB, already rotated for display.
- ``("end", num_frames)``: the proxy pass finished; the child then waits for commands.
- ``("full", [(timestamp_s, image), ...])``: reply to a ``("decode", [timestamp_s, ...])`` command.
- ``("full_frame", timestamp_s, image)`` per frame, then ``("full_end",)``: reply to ``("decode_stream", [...])``.
  The child blocks on each send until the parent reads (the pipe holds about one message), so a slow consumer
  holds at most one full-resolution frame in flight instead of all of them.
- ``("error", code, message)``: a typed failure (codes of `specstream.errors`); the child then exits.

Commands (parent -> child) after ``end``: ``("decode", [timestamp_s, ...])``, ``("decode_stream", [...])`` and
``("close",)``.

Timestamps: ``timestamp_s = (pts - start_pts) * time_base`` computed exactly from integers (correctly rounded),
where ``start_pts`` is the stream's start time (or the first frame's PTS when the container has none).
``frame_index`` counts decoded frames in PTS order from 0.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Iterator

import numpy as np

FRAMES_PER_MESSAGE = 8
MAX_MESSAGE_DELAY_S = 0.2

# Magic bytes of containers we recognise: a file that starts like one of these but cannot be opened is damaged
# (corrupt_media); a file that starts like none of them is not media we support (unsupported_media).
_MAGIC = (
    (4, b"ftyp"),  # mp4 / mov / m4a / 3gp
    (4, b"moov"),
    (4, b"mdat"),
    (4, b"free"),
    (4, b"wide"),
    (0, b"\x1a\x45\xdf\xa3"),  # Matroska / WebM (EBML)
    (0, b"RIFF"),  # AVI / WAV / WebP
    (0, b"GIF87a"),
    (0, b"GIF89a"),
    (0, b"OggS"),
    (0, b"FLV"),
    (0, b"\x00\x00\x01\xba"),  # MPEG-PS
    (0, b"\x47"),  # MPEG-TS sync byte
)


class WorkerError(Exception):
    """A typed failure inside the worker, sent to the parent as ``("error", code, message)``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def looks_like_media(path: str) -> bool:
    """True when the first bytes of ``path`` match a container we recognise (see ``_MAGIC``)."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return False
    return any(head[off : off + len(m)] == m for off, m in _MAGIC)


def check_readable(path: str) -> None:
    """Raise `WorkerError` ``unreadable_source`` for a missing, non-regular, unreadable or empty file."""
    if not os.path.exists(path):
        raise WorkerError("unreadable_source", f"no such file: {path}")
    if os.path.isdir(path):
        raise WorkerError("unreadable_source", f"is a directory, not a media file: {path}")
    if not os.access(path, os.R_OK):
        raise WorkerError("unreadable_source", f"no permission to read: {path}")
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise WorkerError("unreadable_source", f"file is empty (0 bytes): {path}")


def _open_error(path: str, exc: Exception) -> WorkerError:
    if looks_like_media(path):
        return WorkerError("corrupt_media", f"cannot open damaged media file {path}: {exc}")
    return WorkerError("unsupported_media", f"not a supported video/image container: {path}: {exc}")


@dataclass
class Probe:
    """What the worker learns about the video stream before decoding (sent as the ``info`` message)."""

    width: int  # display width (after rotation), pixels
    height: int  # display height (after rotation), pixels
    coded_width: int
    coded_height: int
    rotation: int  # degrees counter-clockwise, multiple of 90, in [0, 360)
    tb_num: int
    tb_den: int
    start_pts: int | None
    duration_s: float | None
    header_frames: int  # frame count stated by the container header (0: unknown)
    codec: str
    container: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def proxy_size(width: int, height: int, long_side: int) -> tuple[int, int]:
    """(w, h) of a proxy whose longer side is ``long_side`` px, aspect kept, both even and >= 2."""
    scale = long_side / max(width, height)
    w = max(2, int(round(width * scale / 2)) * 2)
    h = max(2, int(round(height * scale / 2)) * 2)
    return w, h


def open_video(path: str):
    """Open ``path`` with PyAV and return (container, video stream). Raises `WorkerError`."""
    import av

    check_readable(path)
    try:
        container = av.open(path, mode="r", metadata_errors="ignore")
    except av.error.FileNotFoundError as exc:
        raise WorkerError("unreadable_source", f"no such file: {path}") from exc
    except av.error.PermissionError as exc:
        raise WorkerError("unreadable_source", f"no permission to read: {path}") from exc
    except (av.error.FFmpegError, UnicodeDecodeError, ValueError) as exc:
        raise _open_error(path, exc) from exc
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams})
        container.close()
        raise WorkerError("no_video_stream", f"no video stream in {path} (streams: {', '.join(kinds) or 'none'})")
    stream = container.streams.video[0]
    if stream.codec_context is None or not stream.codec_context.name:
        container.close()
        raise WorkerError("unsupported_media", f"no decoder for the video stream of {path}")
    return container, stream


def probe(path: str) -> Probe:
    """Probe the first video stream of ``path``; decodes one frame to learn the display rotation."""
    import av

    container, stream = open_video(path)
    try:
        rotation = 0
        try:
            for frame in container.decode(stream):
                rotation = int(round(frame.rotation or 0)) % 360
                break
        except av.error.FFmpegError as exc:
            raise WorkerError("corrupt_media", f"cannot decode the first frame of {path}: {exc}") from exc
        tb = stream.time_base or Fraction(1, 1)
        cw, ch = stream.codec_context.width, stream.codec_context.height
        if cw <= 0 or ch <= 0:
            raise WorkerError("corrupt_media", f"video stream of {path} has no frame size")
        w, h = (ch, cw) if rotation in (90, 270) else (cw, ch)
        duration = None
        if stream.duration is not None:
            duration = float(stream.duration * tb)
        elif container.duration is not None:
            duration = container.duration / 1_000_000
        return Probe(
            width=w,
            height=h,
            coded_width=cw,
            coded_height=ch,
            rotation=rotation,
            tb_num=tb.numerator,
            tb_den=tb.denominator,
            start_pts=stream.start_time,
            duration_s=duration,
            header_frames=int(stream.frames or 0),
            codec=stream.codec_context.name,
            container=container.format.name,
        )
    finally:
        container.close()


def rotate(image: np.ndarray, rotation: int) -> np.ndarray:
    """Rotate an ``[h, w, 3]`` image by ``rotation`` degrees counter-clockwise (display matrix convention)."""
    k = (rotation // 90) % 4
    return np.ascontiguousarray(np.rot90(image, k)) if k else image


class _Sender:
    """Batches proxy frames into ``frames`` messages (at most FRAMES_PER_MESSAGE, at most every 0.2 s)."""

    def __init__(self, conn):
        self.conn = conn
        self.batch: list = []
        self.last = time.monotonic()
        self.sent = 0

    def add(self, item) -> None:
        self.batch.append(item)
        now = time.monotonic()
        if len(self.batch) >= FRAMES_PER_MESSAGE or now - self.last >= MAX_MESSAGE_DELAY_S:
            self.flush()

    def flush(self) -> None:
        if self.batch:
            self.conn.send(("frames", self.batch))
            self.sent += len(self.batch)
            self.batch = []
        self.last = time.monotonic()


def _timestamp(pts: int, start: int, p: Probe) -> float:
    return ((pts - start) * p.tb_num) / p.tb_den


def _demux_pts(path: str) -> tuple[list[int] | None, str]:
    """Sorted PTS of all video packets (compressed domain, no decoding), or (None, reason)."""
    import av

    container, stream = open_video(path)
    pts: list[int] = []
    try:
        for packet in container.demux(stream):
            if packet.size == 0:
                continue
            if packet.pts is None:
                return None, "a packet has no PTS"
            pts.append(packet.pts)
    except av.error.FFmpegError as exc:
        return None, f"demux error after {len(pts)} packets: {exc}"
    finally:
        container.close()
    pts.sort()
    return pts, ""


def _decord_plan(conn, path: str, p: Probe, size: tuple[int, int]):
    """Open decord when it can be trusted on this file: returns (reader, sorted packet PTS) or (None, reason)."""
    try:
        import decord
    except ImportError:
        return None, "decord is not installed"
    if p.rotation:
        return None, f"rotation {p.rotation}: decord's rescale ignores it"
    pts, why = _demux_pts(path)
    if pts is None:
        return None, why
    if pts and p.start_pts is not None and pts[0] < p.start_pts:
        return None, "packets before the stream start (an edit list): decord would return them"
    if p.header_frames and p.header_frames != len(pts):
        return None, f"header states {p.header_frames} frames but {len(pts)} packets are present"
    conn.send(("backend", "decord", "opening (a hang from here on is decord's)"))
    try:
        vr = decord.VideoReader(path, width=size[0], height=size[1], num_threads=2)
    except Exception as exc:  # decord raises its own DECORDError (and RuntimeError) types
        return None, f"decord cannot open the file: {str(exc).splitlines()[0][:200]}"
    if len(vr) != len(pts):
        return None, f"decord counts {len(vr)} frames, the demuxer {len(pts)} packets"
    if len(pts):
        ts = vr.get_frame_timestamp(range(len(vr)))[:, 0].astype(np.float64)
        ref = np.array([(x - pts[0]) * p.tb_num / p.tb_den for x in pts])
        if np.max(np.abs((ts - ts[0]) - ref)) > 2e-3:
            return None, "decord's frame timestamps disagree with the packet PTS"
    return (vr, pts), "trusted: frame count and timestamps agree with the demuxer"


def _decode_decord(conn, sender: _Sender, vr, pts: list[int], p: Probe) -> tuple[int, str | None]:
    """Decode with decord; returns (frames sent, failure reason or None)."""
    start = p.start_pts if p.start_pts is not None else (pts[0] if pts else 0)
    n = 0
    try:
        for i in range(len(vr)):
            img = vr.next().asnumpy()
            sender.add((i, pts[i], _timestamp(pts[i], start, p), img))
            n += 1
    except Exception as exc:  # DECORDError
        sender.flush()
        return n, f"decord failed at frame {n}: {str(exc).splitlines()[0][:200]}"
    sender.flush()
    return n, None


def _decode_pyav(path: str, sender: _Sender, p: Probe, size: tuple[int, int], skip: int) -> int:
    """Decode with PyAV, skipping the first ``skip`` frames (already delivered). Returns frames counted."""
    import av

    container, stream = open_video(path)
    stream.thread_type = "AUTO"
    # Proxy size in coded orientation (rotation is applied after scaling).
    cw, ch = (size[1], size[0]) if p.rotation in (90, 270) else size
    start = p.start_pts
    n = 0
    packets = 0
    prev_pts = None
    try:
        for packet in container.demux(stream):
            if packet.size:
                packets += 1
            for frame in packet.decode():
                pts = frame.pts if frame.pts is not None else frame.dts
                if pts is None:  # no timing at all: continue from the previous frame (documented fallback)
                    pts = (prev_pts + 1) if prev_pts is not None else 0
                if start is None:
                    start = pts
                prev_pts = pts
                if n >= skip:
                    img = frame.to_ndarray(width=cw, height=ch, format="rgb24", interpolation="AREA")
                    sender.add((n, pts, _timestamp(pts, start, p), rotate(img, p.rotation)))
                n += 1
    except av.error.FFmpegError as exc:
        sender.flush()
        raise WorkerError("corrupt_media", f"decoding stopped after {n} frames: {exc}") from exc
    finally:
        container.close()
    sender.flush()
    # A file cut short at a packet boundary decodes without an error: the demuxer just ends early. The header's
    # sample count (exact in mp4/mov) tells. Packets, not frames, are compared: an edit list may drop frames.
    if p.header_frames and packets < p.header_frames and p.container.startswith("mov"):
        raise WorkerError(
            "corrupt_media",
            f"truncated: the header states {p.header_frames} frames, the file holds {packets} ({n} decoded)",
        )
    return n


def _key_times(path: str, p: Probe) -> list[float]:
    """Sorted timestamps of the key (random-access) packets of the video stream; demux only, no decoding."""
    import av

    container, stream = open_video(path)
    start = p.start_pts
    out = []
    try:
        for packet in container.demux(stream):
            if packet.size and packet.is_keyframe and packet.pts is not None:
                out.append(_timestamp(packet.pts, start if start is not None else 0, p))
    except av.error.FFmpegError:
        pass  # keyframes up to the damage are enough: targets lie in the decodable part
    finally:
        container.close()
    return sorted(out)


def decode_full(path: str, p: Probe, timestamps_s: list[float]) -> list[tuple[float, np.ndarray]]:
    """All frames of :func:`iter_full` as one list."""
    return list(iter_full(path, p, timestamps_s))


def iter_full(path: str, p: Probe, timestamps_s: list[float]) -> Iterator[tuple[float, np.ndarray]]:
    """Decode the frames presented at ``timestamps_s`` at full resolution (display orientation), yielding
    ``(timestamp_s, image)`` in time order as each is decoded.

    Each target gets the first frame whose timestamp is >= target - 1 us. Targets are visited in time order in
    one forward pass; it seeks only when a key packet lies between the decoding position and the next target
    (so a clip with one GOP is decoded once, not once per target).
    """
    import av

    targets = sorted(set(float(t) for t in timestamps_s))
    if not targets:
        return
    keys = _key_times(path, p)
    container, stream = open_video(path)
    stream.thread_type = "AUTO"
    tb = Fraction(p.tb_num, p.tb_den)
    start = p.start_pts
    try:
        frames = None
        pos = None  # timestamp of the last decoded frame
        for target in targets:
            prev_key = max((k for k in keys if k <= target + 1e-6), default=None)
            ahead = prev_key is not None and prev_key > (pos if pos is not None else 0.0) + 1e-6
            if frames is None or ahead:
                if ahead:
                    base = start or 0
                    container.seek(int(base + Fraction(prev_key) / tb), stream=stream, backward=True)
                frames = container.decode(stream)
            found = None
            for frame in frames:
                pts = frame.pts if frame.pts is not None else frame.dts
                if pts is None:
                    continue
                if start is None:
                    start = pts
                ts = _timestamp(pts, start, p)
                pos = ts
                if ts >= target - 1e-6:
                    found = (ts, rotate(frame.to_ndarray(format="rgb24"), p.rotation))
                    break
            if found is None:
                raise WorkerError("corrupt_media", f"no frame at or after {target:.6f} s in {path}")
            yield found
    except av.error.FFmpegError as exc:
        raise WorkerError("corrupt_media", f"full-resolution decode failed: {exc}") from exc
    finally:
        container.close()


def proxy_session(conn, path: str, long_side: int, backend: str, skip: int) -> None:
    """Child-process entry point: probe, stream proxy frames, then serve full-resolution decode commands."""
    try:
        p = probe(path)
        conn.send(("info", p.to_dict()))
        size = proxy_size(p.width, p.height, long_side)
        sender = _Sender(conn)
        n = skip
        done = False
        if backend in ("auto", "decord") and skip == 0:
            plan, why = _decord_plan(conn, path, p, size)
            if plan is None and backend == "decord":
                raise WorkerError("unsupported_media", f"decord cannot be used on {path}: {why}")
            if plan is not None:
                conn.send(("backend", "decord", why))
                n, failure = _decode_decord(conn, sender, plan[0], plan[1], p)
                done = failure is None
                if failure:
                    why = failure
            if not done:
                conn.send(("backend", "pyav", f"fallback: {why}"))
        else:
            conn.send(("backend", "pyav", "requested" if backend == "pyav" else f"resume after {skip} frames"))
        if not done:
            n = _decode_pyav(path, sender, p, size, skip=n)
        conn.send(("end", n))
        while True:
            cmd = conn.recv()
            if cmd[0] == "decode":
                conn.send(("full", decode_full(path, p, list(cmd[1]))))
            elif cmd[0] == "decode_stream":
                for ts, img in iter_full(path, p, list(cmd[1])):
                    conn.send(("full_frame", ts, img))
                conn.send(("full_end",))
            else:
                break
    except WorkerError as exc:
        _send_quiet(conn, ("error", exc.code, exc.message))
    except ImportError as exc:
        _send_quiet(conn, ("error", "missing_dependency", f"{exc}: pip install 'specstream[video]'"))
    except (EOFError, BrokenPipeError):
        pass
    except Exception as exc:  # an unexpected failure is still reported as a typed error, never a hang
        _send_quiet(conn, ("error", "corrupt_media", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def full_session(conn, path: str, timestamps_s: list[float]) -> None:
    """Child-process entry point of `video.decode_frames`: probe, decode the targets, reply once."""
    try:
        p = probe(path)
        conn.send(("info", p.to_dict()))
        conn.send(("full", decode_full(path, p, timestamps_s)))
    except WorkerError as exc:
        _send_quiet(conn, ("error", exc.code, exc.message))
    except ImportError as exc:
        _send_quiet(conn, ("error", "missing_dependency", f"{exc}: pip install 'specstream[video]'"))
    except Exception as exc:
        _send_quiet(conn, ("error", "corrupt_media", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def inherited_fd_path(dup) -> str:
    """Unpickles `video._InheritedFd` in the child: the duplicated descriptor as this process's
    ``/proc/self/fd/M`` (opening that name opens the parent's file, not a path)."""
    return f"/proc/self/fd/{dup.detach()}"


def _send_quiet(conn, msg) -> None:
    try:
        conn.send(msg)
    except (OSError, EOFError, BrokenPipeError):
        pass
