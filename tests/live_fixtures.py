"""Shared fixtures of the live-subtitle tests: espeak-ng recordings with known sentence ends, a uvicorn server
on a loopback port in a background thread, WER."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from whisper_fixtures import speak

SCRIPT = (
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "We will meet at the station at nine o'clock tomorrow morning.",
    "The weather is cold and windy today.",
    "She sells sea shells by the sea shore.",
    "My favorite color is blue.",
    "Turn left at the next traffic light.",
    "The library opens at eight in the morning.",
    "He bought a new bicycle last week.",
    "Thank you very much for your help.",
)
GAP_S = 0.5


def recording(out_dir: Path, sentences=SCRIPT, gap_s: float = GAP_S) -> tuple[Path, np.ndarray, list[float]]:
    """Sentences spoken by espeak-ng, joined with ``gap_s`` of silence: (WAV path, 16 kHz samples, sentence ends s)."""
    import scipy.io.wavfile

    from specstream.modalities.audio import load_audio

    parts, ends, t = [], [], 0.0
    for i, s in enumerate(sentences):
        a = load_audio(speak(s, out_dir / f"sentence{i}.wav"))
        nz = np.flatnonzero(np.abs(a) > 1e-3)
        ends.append(t + (nz[-1] + 1) / 16000 if len(nz) else t)
        parts += [a, np.zeros(int(gap_s * 16000), np.float32)]
        t += (len(a) + int(gap_s * 16000)) / 16000
    audio = np.concatenate(parts)
    path = out_dir / "recording.wav"
    scipy.io.wavfile.write(path, 16000, (audio * 32768).clip(-32768, 32767).astype(np.int16))
    return path, audio, ends


def normalize(text: str) -> str:
    text = text.lower().replace("o'clock", "oclock")
    for d, w in (("9", "nine"), ("8", "eight"), ("favourite", "favorite"), ("colour", "color")):
        text = re.sub(rf"\b{d}\b", w, text)
    return " ".join(re.sub(r"[^a-z' ]+", " ", text).split())


def wer(reference: str, hypothesis: str) -> float:
    import jiwer

    return jiwer.wer(normalize(reference), normalize(hypothesis))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving ``create_app(settings)`` on a loopback port in a daemon thread."""

    def __init__(self, settings):
        import uvicorn

        from specstream.pipeline.server import create_app, uvicorn_options

        self.settings = settings
        self.app = create_app(settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, **uvicorn_options(settings), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.settings.port}/v1/subtitles"

    def start(self, timeout: float = 180.0) -> "ServerThread":
        import httpx

        self.thread.start()
        t0 = time.time()
        while time.time() - t0 < timeout:
            try:
                if httpx.get(self.base + "/readyz", headers=self.auth(), timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not become ready")

    def auth(self) -> dict:
        keys = self.settings.api_keys
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
