"""``WS /v1/subtitles`` fuzzed with hypothesis against a live server (uvicorn on loopback, the real WebSocket
protocol layer): random JSON events (start messages with random fields and values, stop, unknown types, non-JSON
text), binary frames of random and odd lengths, events out of order (a start after audio, audio after stop), and
frames over ``max_frame_bytes``. Every session must end within a bound with a close code of the table in
``docs/streaming.md`` (1000 after ``done``, 1007, 1008, 1009), every message sent must be JSON of a documented
type, and nothing may be logged with a traceback. (``/v1/realtime`` does not exist on this branch.)"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from live_fixtures import ServerThread, free_port

MAX_FRAME = 4096
DOCUMENTED_CLOSES = {1000, 1007, 1008, 1009}
MESSAGE_TYPES = {"partial", "final", "done"}
SESSION_BOUND_S = 30.0
RESULTS: dict[int, int] = {}


class _Tracebacks(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(record)


@pytest.fixture(scope="module")
def live():
    from specstream.pipeline.server import ServerSettings

    catcher = _Tracebacks()
    loggers = [logging.getLogger(n) for n in ("specstream", "uvicorn", "uvicorn.error", "uvicorn.asgi")]
    for lg in loggers:
        lg.addHandler(catcher)
    srv = ServerThread(ServerSettings(port=free_port(), max_frame_bytes=MAX_FRAME, idle_timeout_s=1.5,
                                      max_sessions=64)).start()
    yield srv, catcher
    srv.stop()
    for lg in loggers:
        lg.removeHandler(catcher)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
                           | st.text(max_size=12), lambda c: st.lists(c, max_size=3)
                           | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=6)
start_events = st.fixed_dictionaries({"type": st.just("start")}, optional={
    "sample_rate": st.sampled_from([8000, 16000, 22050, 44100, 48000, 7999, 0, -1, 10**9]) | json_values,
    "format": st.sampled_from(["pcm_s16le", "f32le", "mp3"]) | json_values,
    "language": st.sampled_from(["en", "de", "xx"]) | json_values}) | st.dictionaries(
    st.sampled_from(["type", "sample_rate", "format", "language", "extra"]), json_values, max_size=4).map(
    lambda d: {**d, "type": "start"})
text_events = (start_events.map(json.dumps) | st.just(json.dumps({"type": "stop"}))
               | st.dictionaries(st.text(max_size=8), json_values, max_size=3).map(json.dumps)
               | json_values.map(json.dumps) | st.text(max_size=40))
binary_events = (st.binary(min_size=0, max_size=600) | st.integers(1, 4000).map(lambda n: bytes(n | 1))
                 | st.integers(MAX_FRAME + 1, 3 * MAX_FRAME).map(lambda n: b"\x01" * n))
events = st.lists(text_events.map(lambda t: ("text", t)) | binary_events.map(lambda b: ("bytes", b)),
                  min_size=0, max_size=8)


async def _session(url: str, script: list[tuple[str, object]], then_stop: bool) -> tuple[int, list[dict]]:
    import websockets

    got: list[dict] = []
    async with websockets.connect(url, open_timeout=20, max_size=None) as ws:
        try:
            for kind, payload in script:
                await ws.send(payload)
            if then_stop:
                await ws.send(json.dumps({"type": "stop"}))
            while True:
                msg = await ws.recv()
                got.append(json.loads(msg))
        except websockets.ConnectionClosed:
            pass
        return ws.close_code, got


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(script=events, then_stop=st.booleans())
def _fuzz_once(live, script, then_stop):
    srv, catcher = live
    # a frame over the limit ends the session (1009); the client goes on writing the rest of its script, and must
    # still see 1009 (the server reads and discards until the client closes: never a reset that loses the close)
    code, got = asyncio.run(asyncio.wait_for(_session(srv.ws_url, script, then_stop), SESSION_BOUND_S))
    RESULTS[code] = RESULTS.get(code, 0) + 1
    assert code in DOCUMENTED_CLOSES, (code, script)
    assert all(isinstance(m, dict) and m.get("type") in MESSAGE_TYPES for m in got), got
    if code == 1000:
        assert got and got[-1] == {"type": "done"}
    assert not catcher.records, [r.getMessage() for r in catcher.records]


def test_subtitles_websocket_fuzz(live):
    _fuzz_once(live)
    print(f"close codes: {RESULTS}")
    assert {1000, 1007, 1009} <= set(RESULTS)  # the fuzz reached the normal end and both refusals


async def _keeps_writing(url: str, frames_after: int) -> int:
    import websockets

    async with websockets.connect(url, open_timeout=20, max_size=None) as ws:
        try:
            await ws.send(json.dumps({"type": "start"}))
            await ws.send(b"\x01" * (3 * MAX_FRAME))
            for _ in range(frames_after):
                await ws.send(b"\x00\x00" * 1000)
            while True:
                await ws.recv()
        except websockets.ConnectionClosed:
            pass
        return ws.close_code


def test_huge_frame_closes_1009_even_when_the_client_keeps_writing(live):
    """The occasional 1006 after a 1009: uvicorn closed the socket right after the close frame, the client's
    frames still arriving met a closed socket, and the kernel's reset overtook the close frame. Measured before the
    fix with 60 frames written after a 12 KiB one: 20 of 60 sessions saw 1006 (7 of 60 with 20 frames)."""
    srv, catcher = live
    codes = [asyncio.run(asyncio.wait_for(_keeps_writing(srv.ws_url, 60), SESSION_BOUND_S)) for _ in range(40)]
    assert codes == [1009] * 40, {c: codes.count(c) for c in set(codes)}
    assert not catcher.records, [r.getMessage() for r in catcher.records]


def test_out_of_order_and_huge_frames_close_with_their_codes(live):
    srv, _ = live
    cases = [
        ([("bytes", b"\x00\x00" * 100), ("text", json.dumps({"type": "start"}))], False, 1007),
        ([("text", json.dumps({"type": "stop"})), ("bytes", b"\x00\x00" * 10)], False, 1000),
        ([("bytes", b"\x00" * 3)], True, 1007),
        ([("bytes", b"\x00" * (MAX_FRAME + 2))], True, 1009),
        ([("text", "[1, 2]")], True, 1007),
        ([("text", json.dumps({"type": "start", "sample_rate": "x"}))], True, 1007),
    ]
    for script, stop, want in cases:
        code, got = asyncio.run(asyncio.wait_for(_session(srv.ws_url, script, stop), SESSION_BOUND_S))
        assert code == want, (script, code, got)
