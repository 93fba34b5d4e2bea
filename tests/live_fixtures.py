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

#: the longer recording: a news bulletin with numbers, spoken by espeak-ng with these pauses after each sentence
#: (seconds); about 62 s in all
LONG_SCRIPT = (
    ("Good morning, this is the weather report for Tuesday.", 0.4),
    ("Temperatures will reach 24 degrees in the afternoon.", 1.5),
    ("There is a 30 percent chance of rain after 6 o'clock.", 0.6),
    ("The wind comes from the north at 15 kilometres per hour.", 2.5),
    ("Tomorrow will be colder, with a high of 18 degrees.", 0.5),
    ("Now the traffic news.", 3.0),
    ("The main road is closed between exits 4 and 7.", 0.7),
    ("Trains on line 3 run every 10 minutes.", 0.5),
    ("The ferry leaves at half past 8 and returns at noon.", 1.2),
    ("The museum opens at 9 and closes at 5.", 0.8),
    ("Tickets cost 12 euros for adults, and children under 6 go free.", 2.0),
    ("That is all for now.", 0.6),
    ("Our next report comes in 2 hours.", 0.5),
    ("Thank you for listening, and have a good day.", 0.8),
    ("This was report number 7.", 0.5),
)


class Recording:
    """Sentences spoken by espeak-ng and joined with known pauses: the ground truth of the speech tests.

    Attributes:
        path: a 16 kHz mono WAV of ``audio``; audio: float32 samples.
        sentences: the texts; spans: each sentence's speech ``(start_s, end_s)`` (first and last sample above
            -60 dBFS).
    """

    def __init__(self, path: Path, audio: np.ndarray, sentences: tuple[str, ...], spans: list[tuple[float, float]]):
        self.path, self.audio, self.sentences, self.spans = path, audio, sentences, spans

    @property
    def text(self) -> str:
        return " ".join(self.sentences)

    @property
    def duration_s(self) -> float:
        return len(self.audio) / 16000


def compose(out_dir: Path, sentences, gaps, lead_s: float = 0.0, name: str = "recording") -> Recording:
    """Speak each sentence (cached per text in ``out_dir``) and join them: ``lead_s`` of silence first, then each
    sentence followed by its gap (seconds)."""
    import hashlib

    import scipy.io.wavfile

    from specstream.modalities.audio import load_audio

    parts = [np.zeros(int(lead_s * 16000), np.float32)]
    spans, t = [], lead_s
    for s, gap in zip(sentences, gaps):
        wav = out_dir / f"say-{hashlib.sha1(s.encode()).hexdigest()[:12]}.wav"
        if not wav.exists():
            speak(s, wav)
        a = load_audio(wav)
        nz = np.flatnonzero(np.abs(a) > 1e-3)
        spans.append((t + nz[0] / 16000, t + (nz[-1] + 1) / 16000) if len(nz) else (t, t))
        parts += [a, np.zeros(int(gap * 16000), np.float32)]
        t += (len(a) + int(gap * 16000)) / 16000
    audio = np.concatenate(parts)
    path = out_dir / f"{name}.wav"
    scipy.io.wavfile.write(path, 16000, (audio * 32768).clip(-32768, 32767).astype(np.int16))
    return Recording(path, audio, tuple(sentences), spans)


def recording(out_dir: Path, sentences=SCRIPT, gap_s: float = GAP_S) -> tuple[Path, np.ndarray, list[float]]:
    """Sentences spoken by espeak-ng, joined with ``gap_s`` of silence: (WAV path, 16 kHz samples, sentence ends s)."""
    rec = compose(out_dir, sentences, [gap_s] * len(sentences))
    return rec.path, rec.audio, [b for _, b in rec.spans]


def long_recording(out_dir: Path) -> Recording:
    return compose(out_dir, [s for s, _ in LONG_SCRIPT], [g for _, g in LONG_SCRIPT], name="bulletin")


_ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
        "seventeen eighteen nineteen".split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """English words of ``0 <= n < 1000`` (larger numbers stay digits)."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    if n < 1000:
        return _ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + number_words(n % 100))
    return str(n)


def normalize(text: str) -> str:
    """Lower case, digits as words, a few spellings unified (``%``, ``km``, contractions), punctuation dropped: the
    script and the transcripts compare word for word."""
    text = text.lower().replace("o'clock", "oclock").replace("%", " percent")
    text = re.sub(r"(\d+)(st|nd|rd|th)\b", r"\1", text)
    text = re.sub(r"\d+", lambda m: " " + number_words(int(m.group())) + " ", text)
    for a, b in (("favourite", "favorite"), ("colour", "color"), ("kilometers", "kilometres"), ("km", "kilometres"),
                 ("that's", "that is"), ("we'll", "we will"), ("it's", "it is")):
        text = re.sub(rf"\b{a}\b", b, text)
    return " ".join(re.sub(r"[^a-z' ]+", " ", text).replace("-", " ").split())


def wer(reference: str, hypothesis: str) -> float:
    import jiwer

    return jiwer.wer(normalize(reference), normalize(hypothesis) or "-")


def uncovered_speech(spans: list[tuple[float, float]], finals: list[tuple[float, float]], step_s: float = 1.0,
                     tolerance_s: float = 0.5) -> list[float]:
    """Points of speech (every ``step_s`` inside each sentence, and its middle) that no final's
    ``[start_s - tolerance_s, end_s + tolerance_s]`` contains: the speech no final covers."""
    out = []
    for a, b in spans:
        points = list(np.arange(a + min(step_s, (b - a) / 2), b, step_s)) + [(a + b) / 2]
        for t in points:
            if not any(s - tolerance_s <= t <= e + tolerance_s for s, e in finals):
                out.append(round(float(t), 2))
    return out


async def ws_stream(url: str, audio16k: np.ndarray, chunk_s: float = 0.5, pace: float | None = 1.0,
                    start: dict | None = None, timeout_s: float = 120.0):
    """Send ``audio16k`` to ``/v1/subtitles`` as pcm_s16le chunks at ``pace`` x real time (None: as fast as the
    socket takes them), then ``stop``; returns ``([(clock, message), ...], close code)``, every server message with
    the monotonic clock it arrived at."""
    import json

    from websockets.asyncio.client import connect

    msgs = []
    async with connect(url, max_size=None) as ws:
        if start is not None:
            await ws.send(json.dumps(start))

        async def reader():
            async for m in ws:
                msgs.append((time.monotonic(), json.loads(m)))

        rt = asyncio.create_task(reader())
        step = int(chunk_s * 16000)
        t0 = time.monotonic()
        for k, i in enumerate(range(0, len(audio16k), step)):
            if pace is not None:
                await asyncio.sleep(max(0.0, t0 + k * chunk_s / pace - time.monotonic()))
            await ws.send((audio16k[i:i + step] * 32768).clip(-32768, 32767).astype("<i2").tobytes())
        await ws.send(json.dumps({"type": "stop"}))
        await asyncio.wait_for(rt, timeout_s)
        return msgs, ws.close_code


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


def metric(text: str, name: str, label: str = "") -> float:
    """The sum of the Prometheus samples of ``name`` whose line contains ``label``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def sm(speech_cache):
    """Whisper tiny.en, loaded once per module (needs ``speech_cache`` imported beside it)."""
    from specstream.stages.speech import SpeechModel

    return SpeechModel.load()


@pytest.fixture(scope="module")
def rec3(tmp_path_factory):
    """The first three sentences of :data:`SCRIPT`, spoken: ``(wav path, samples, sentence starts)``."""
    return recording(tmp_path_factory.mktemp("rec3"), SCRIPT[:3])
