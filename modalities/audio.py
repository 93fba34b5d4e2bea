"""Audio -> tensors for Whisper: decode any file (wav, mp3, the audio track of a video) to 16 kHz mono float32,
and compute 30-s log-mel windows.

Decoding uses PyAV (FFmpeg) with the same resampler settings as faster-whisper's ``decode_audio`` (signed 16-bit,
mono, 16 kHz, then ``/ 32768``), so both see identical samples. Log-mel features come from Hugging Face's
``WhisperFeatureExtractor``, constructed here (no ``preprocessor_config.json`` ships with the converted models):
``n_fft`` 400, hop 160 (10 ms per frame), 80 or 128 mel bins, 30-s windows of 3000 frames.

Windows (:func:`mel_window`) are built as faster-whisper >= 1.1 builds them: the log-mel spectrogram of the
whole audio (padded by one hop) is computed once, normalized by its global maximum, cut into 3000-frame windows
and zero-padded *in feature space*. (OpenAI's reference pads the waveform with 30 s of silence instead; the
``pad="audio"`` mode of :func:`log_mel` does that for one window.)
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from specstream.errors import SpecstreamError, UnreadableSourceError
from specstream.modalities.source import open_source

SAMPLE_RATE = 16000  # Hz
HOP_LENGTH = 160  # samples per mel frame (10 ms)
N_FFT = 400
WINDOW_SECONDS = 30
WINDOW_FRAMES = WINDOW_SECONDS * SAMPLE_RATE // HOP_LENGTH  # 3000
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100


class AudioDecodeError(SpecstreamError):
    """The file could not be opened or has no decodable audio stream."""

    code = "audio_decode_error"


def check_readable(path: str | os.PathLike) -> None:
    """Raise `UnreadableSourceError` (``unreadable_source``) unless ``path`` is a regular file that this process
    can open for reading and that holds at least one byte (the same checks, and words, as the video and image
    loaders); nothing is decoded."""
    with open_source(path) as opened:
        if opened.size == 0:
            raise UnreadableSourceError(f"file is empty (0 bytes): {path}")


def load_audio(path: str | os.PathLike, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Decode the first audio stream of ``path`` (an audio file or a video) to mono float32 in [-1, 1).

    Args:
        path: any container FFmpeg reads (wav, flac, mp3, ogg, mp4, mkv, webm, ...).
        sample_rate: output rate in Hz.

    Returns:
        ``[num_samples]`` float32.

    Raises:
        UnreadableSourceError: missing, a directory, no permission, or empty (0 bytes): the code ``caption``
            gives the same fault (``unreadable_source``).
        AudioDecodeError: no audio stream, corrupt data.
    """
    import av

    p = Path(path)
    check_readable(p)
    resampler = av.AudioResampler(format="s16", layout="mono", rate=sample_rate)
    chunks: list[np.ndarray] = []
    try:
        with av.open(str(p), metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise AudioDecodeError(f"{p}: no audio stream")
            stream = container.streams.audio[0]
            for frame in container.decode(stream):
                frame.pts = None  # let the resampler ignore gaps in the source timestamps
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except AudioDecodeError:
        raise
    except Exception as exc:  # av.error.*: invalid data, unsupported codec, ...
        raise AudioDecodeError(f"{p}: cannot decode audio ({type(exc).__name__}: {exc})") from None
    if not chunks:
        return np.zeros(0, dtype=np.float32)
    return (np.concatenate(chunks).astype(np.float32) / 32768.0).astype(np.float32)


@lru_cache(maxsize=4)
def whisper_feature_extractor(num_mel_bins: int = 80):
    """Hugging Face ``WhisperFeatureExtractor`` for ``num_mel_bins`` (80: tiny ... large-v2; 128: large-v3)."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=SAMPLE_RATE, hop_length=HOP_LENGTH,
                                   chunk_length=WINDOW_SECONDS, n_fft=N_FFT)


def log_mel(audio: np.ndarray, num_mel_bins: int = 80, pad: str = "hop") -> np.ndarray:
    """Log-mel spectrogram ``[num_mel_bins, num_frames]`` float32 of 16 kHz mono ``audio``.

    Args:
        audio: ``[num_samples]`` float32.
        num_mel_bins: mel bands.
        pad: ``"hop"`` (faster-whisper): append one hop of zeros; frames = ``num_samples // 160 + 1``, of
            which the first ``num_samples // 160`` are content (see :func:`mel_window`). ``"audio"`` (OpenAI /
            Hugging Face): pad or trim the waveform to 30 s; exactly 3000 frames.
    """
    if audio.ndim != 1:
        raise ValueError(f"audio must be [num_samples], got {audio.shape}")
    fe = whisper_feature_extractor(num_mel_bins)
    audio = np.asarray(audio, dtype=np.float32)
    if pad == "hop":
        padded = np.pad(audio, (0, HOP_LENGTH))
        feats = fe(padded, sampling_rate=SAMPLE_RATE, padding="longest", truncation=False,
                   return_tensors="np").input_features[0]
    elif pad == "audio":
        feats = fe(audio, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
    else:
        raise ValueError(f"pad must be 'hop' or 'audio', got {pad!r}")
    return feats.astype(np.float32)


def content_frames(mel: np.ndarray) -> int:
    """Frames of ``mel`` (from ``log_mel(pad="hop")``) that hold audio: all but the padding frame."""
    return max(0, mel.shape[-1] - 1)


def mel_window(mel: np.ndarray, start: int, num_frames: int = WINDOW_FRAMES) -> tuple[np.ndarray, int]:
    """The ``num_frames``-frame window of ``mel`` starting at frame ``start``, zero-padded at the end.

    Returns:
        ``(window [num_mel_bins, num_frames] float32, content frames in the window)``.
    """
    n = max(0, min(num_frames, content_frames(mel) - start))
    out = np.zeros((mel.shape[0], num_frames), dtype=np.float32)
    out[:, :n] = mel[:, start:start + n]
    return out, n
