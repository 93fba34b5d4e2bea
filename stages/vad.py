"""Voice activity detection with Silero VAD (the ONNX model shipped by the ``silero-vad`` package), streamed.

The model file is located with ``importlib.util.find_spec`` and run with onnxruntime: the ``silero_vad`` Python
package is never imported, because importing it sets torch's intra-op thread count to 1 (see
``docs/streaming.md``), which would halve the engine's speed.

The model takes 512-sample frames of 16 kHz audio (32 ms) with the previous frame's last 64 samples as context
and a recurrent state ``[2, 1, 128]``; it returns the probability that the frame holds speech. One
:class:`StreamingVad` per audio stream keeps that state; the ONNX session is shared by all streams.
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


@lru_cache(maxsize=1)
def _session():
    try:
        import onnxruntime
    except ImportError:
        raise VadUnavailableError("voice activity detection needs onnxruntime (pip install 'specstream[serve]')") \
            from None
    opts = onnxruntime.SessionOptions()
    opts.inter_op_num_threads = 1
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    return onnxruntime.InferenceSession(str(silero_model_path()), sess_options=opts,
                                        providers=["CPUExecutionProvider"])


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

        The model is recurrent, so its frames run one call each, in order; everything else (each frame's
        64-sample context, its RMS, the speech flags) is computed for all frames of the chunk at once (62 s of
        audio in one chunk on the AVX2 EPYC of docs/benchmarks.md: 0.40-0.50 s frame by frame, 0.32-0.39 s so)."""
        buf = np.concatenate([self._pending, np.asarray(samples, dtype=np.float32)])
        n = len(buf) // FRAME
        if n:
            frames = buf[:n * FRAME].reshape(n, FRAME)
            inputs = np.concatenate([np.concatenate([self._context, frames[:-1, -CONTEXT:]]), frames], axis=1)
            rms = np.sqrt(np.mean(frames * frames, axis=1))  # [n]
            sr = np.array(SAMPLE_RATE, dtype=np.int64)
            state, probs = self._state, np.empty(n, dtype=np.float32)
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
