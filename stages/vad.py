"""Voice activity detection with Silero VAD (the ONNX model shipped by the ``silero-vad`` package), streamed.

The model file is located with ``importlib.util.find_spec`` and run with onnxruntime: the ``silero_vad`` Python
package is never imported, because importing it sets torch's intra-op thread count to 1 (see
``docs/streaming.md``), which would halve the engine's speed.

The model takes 512-sample frames of 16 kHz audio (32 ms) with the previous frame's last 64 samples as context
and a recurrent state ``[2, 1, 128]``; it returns the probability that the frame holds speech. One
:class:`StreamingVad` per audio stream keeps that state; the ONNX session is shared by all streams.

A chunk of many frames runs through the package's sequence export of the same model
(``silero_vad_16k_sequence.onnx``, silero-vad 6.2 and later, after snakers4/silero-vad PR 784): one call per block
of up to :data:`SEQUENCE_BLOCK` frames, the recurrent state carried between calls, and the same probabilities bit
for bit (``tests/test_vad.py``). faster-whisper batches its VAD the same way. Without that file (an older
silero-vad), frames run one call each, with the same results.
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from specstream.errors import SpecstreamError

FRAME = 512  # samples per VAD frame at 16 kHz (32 ms)
SEQUENCE_BLOCK = 512  # frames per call of the sequence model (16.4 s of audio)
CONTEXT = 64  # samples of the previous frame prepended to each frame
SAMPLE_RATE = 16000


class VadUnavailableError(SpecstreamError):
    code = "missing_dependency"


def silero_model_path() -> Path:
    """``silero_vad/data/silero_vad.onnx`` of the installed ``silero-vad`` package (not imported).

    Raises:
        VadUnavailableError: the package is not installed.
    """
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise VadUnavailableError("voice activity detection needs the silero-vad package "
                                  "(pip install 'specstream[serve]')")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "silero_vad.onnx"
    if not path.is_file():
        raise VadUnavailableError(f"{path}: missing from the silero-vad package")
    return path


def _open(path: Path):
    """An onnxruntime session of ``path`` on one thread (streams share it; see ``_RUN_LOCK``).

    Raises:
        VadUnavailableError: onnxruntime is not installed.
    """
    try:
        import onnxruntime
    except ImportError:
        raise VadUnavailableError("voice activity detection needs onnxruntime (pip install 'specstream[serve]')") \
            from None
    opts = onnxruntime.SessionOptions()
    opts.inter_op_num_threads = 1
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    return onnxruntime.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


@lru_cache(maxsize=1)
def _session():
    """The per-frame model's session (``silero_vad.onnx``)."""
    return _open(silero_model_path())


@lru_cache(maxsize=1)
def _sequence_session():
    """The session of the package's sequence model (frames ``[T, 576]`` and the state as ``h``, ``c``
    ``[1, 1, 128]`` in; per-frame probabilities ``[T]`` and the state out), or None when the installed silero-vad
    does not ship it."""
    path = silero_model_path().with_name("silero_vad_16k_sequence.onnx")
    return _open(path) if path.is_file() else None


_RUN_LOCK = threading.Lock()


@dataclass(frozen=True)
class VadConfig:
    """Thresholds of the speech gate.

    Attributes:
        threshold: a frame is speech when its probability is at least this.
        min_silence_s: a speech region ends after this much non-speech (Silero's ``min_silence_duration_ms``).
        min_rms: frames quieter than this (RMS, full scale 1.0) are silence whatever the model says; digital
            silence and very quiet noise never reach the encoder.
    """

    threshold: float = 0.5
    min_silence_s: float = 0.3
    min_rms: float = 1e-3


class StreamingVad:
    """Per-stream Silero VAD: feed samples in any chunk size, read per-frame speech flags.

    Frame ``i`` covers samples ``[i * 512, (i + 1) * 512)`` of the stream (absolute, from stream start).
    """

    def __init__(self, config: VadConfig | None = None):
        self.config = config or VadConfig()
        self._sess = _session()
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._context = np.zeros((1, CONTEXT), dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)
        self.probs: list[float] = []  # per frame
        self.speech: list[bool] = []  # per frame, after the RMS floor

    @property
    def frames(self) -> int:
        return len(self.probs)

    @property
    def end_s(self) -> float:
        """Audio seconds analysed so far (whole frames)."""
        return self.frames * FRAME / SAMPLE_RATE

    def accept(self, samples: np.ndarray) -> None:
        """Analyse ``samples`` ``[n]`` float32 16 kHz (continuing the stream).

        The model is recurrent: its frames run in order, through the sequence model in blocks of
        :data:`SEQUENCE_BLOCK` frames (one call each, the state carried between them), or one call per frame
        without it; everything else (each frame's 64-sample context, its RMS, the speech flags) is computed for
        all frames of the chunk at once. On one core of the AVX2-only AMD EPYC Zen 3 of ``docs/benchmarks.md``,
        the 32.5-s espeak-ng recording took 0.23 s frame by frame and 0.074 s in blocks, the 62-s bulletin 0.44 s
        and 0.18 s (same probabilities; read bandwidth and faster-whisper not measured in this probe: the offline
        transcription run of 13:37 UTC in ``docs/benchmarks.md`` has both). Streams share one session and
        take turns per call: a stream with a long chunk holds the others for one block at a time (about 35 ms)."""
        buf = np.concatenate([self._pending, np.asarray(samples, dtype=np.float32)])
        n = len(buf) // FRAME
        if n:
            frames = buf[:n * FRAME].reshape(n, FRAME)
            inputs = np.concatenate([np.concatenate([self._context, frames[:-1, -CONTEXT:]]), frames], axis=1)
            rms = np.sqrt(np.mean(frames * frames, axis=1))  # [n]
            state, probs = self._state, np.empty(n, dtype=np.float32)
            seq = _sequence_session() if n > 1 else None
            if seq is not None:
                h, c = state[0:1], state[1:2]
                for a in range(0, n, SEQUENCE_BLOCK):
                    with _RUN_LOCK:
                        out, h, c = seq.run(None, {"input": inputs[a:a + SEQUENCE_BLOCK], "h": h, "c": c})
                    probs[a:a + SEQUENCE_BLOCK] = out.reshape(-1)
                state = np.concatenate([h, c])
            else:
                sr = np.array(SAMPLE_RATE, dtype=np.int64)
                for i in range(n):
                    with _RUN_LOCK:
                        out, state = self._sess.run(None, {"input": inputs[i:i + 1], "state": state, "sr": sr})
                    probs[i] = out.reshape(-1)[0]
            self._state, self._context = state, frames[-1:, -CONTEXT:].copy()
            self.probs.extend(probs.tolist())
            # compared in float64, as a Python float against the thresholds (not in float32)
            cfg = self.config
            speech = (probs.astype(np.float64) >= cfg.threshold) & (rms.astype(np.float64) >= cfg.min_rms)
            self.speech.extend(speech.tolist())
        self._pending = buf[n * FRAME:].copy()

    def has_speech(self, start_s: float, end_s: float) -> bool:
        """True when a speech frame overlaps ``[start_s, end_s)``."""
        a = max(0, int(start_s * SAMPLE_RATE) // FRAME)
        b = min(self.frames, -(-int(end_s * SAMPLE_RATE) // FRAME))
        return any(self.speech[a:b])

    def speech_offsets(self, start_s: float, end_s: float) -> list[float]:
        """Times (s) in ``[start_s, end_s]`` where a speech region ended: the end of a speech frame followed by
        at least ``min_silence_s`` of non-speech frames (analysed so far)."""
        gap = max(1, round(self.config.min_silence_s * SAMPLE_RATE / FRAME))
        a = max(0, int(start_s * SAMPLE_RATE) // FRAME)
        b = min(self.frames, int(end_s * SAMPLE_RATE) // FRAME + 1)
        out = []
        for i in range(a, b):
            if self.speech[i] and i + gap < self.frames + 1 and not any(self.speech[i + 1:i + 1 + gap]) \
                    and i + gap <= self.frames:
                t = (i + 1) * FRAME / SAMPLE_RATE
                if start_s <= t <= end_s:
                    out.append(t)
        return out

    def last_speech_end_s(self) -> float | None:
        """End time of the last speech frame, or None when no speech was heard."""
        for i in range(self.frames - 1, -1, -1):
            if self.speech[i]:
                return (i + 1) * FRAME / SAMPLE_RATE
        return None
