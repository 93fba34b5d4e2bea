"""OpenAI's realtime transcription protocol (``WS /v1/realtime?intent=transcription``) and ``stream=true`` on
``/v1/audio/transcriptions``.

Driven by the official ``openai`` client (``client.beta.realtime.connect``: the installed version's beta realtime
API has transcription sessions; ``client.audio.transcriptions.create(..., stream=True)``), and by raw
``websockets`` for bad input. Every server event is validated against the ``openai`` package's pydantic types.
Oracle: the same recognizer (``stages.streaming.replay``) over the same 16 kHz samples the server decodes.
"""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import openai
import pytest
from openai.types.beta.realtime import (ConversationItemInputAudioTranscriptionCompletedEvent,
                                        ConversationItemInputAudioTranscriptionDeltaEvent, ErrorEvent,
                                        InputAudioBufferClearedEvent, InputAudioBufferCommittedEvent,
                                        InputAudioBufferSpeechStartedEvent, InputAudioBufferSpeechStoppedEvent)
from openai.types.beta.realtime.transcription_session_update import Session as TranscriptionSessionConfig

from live_fixtures import SCRIPT, ServerThread, compose, free_port
from whisper_fixtures import speech_cache  # noqa: F401  (fixture)

KEY = "sk-realtime-test"
HOP_S = 1.0  # the server's min_hop_s here (fewer passes: this machine is slow), and the oracle's

#: every server event type of a transcription session -> the openai package's model of it
EVENT_TYPES = {
    "conversation.item.input_audio_transcription.delta": ConversationItemInputAudioTranscriptionDeltaEvent,
    "conversation.item.input_audio_transcription.completed": ConversationItemInputAudioTranscriptionCompletedEvent,
    "input_audio_buffer.committed": InputAudioBufferCommittedEvent,
    "input_audio_buffer.cleared": InputAudioBufferClearedEvent,
    "input_audio_buffer.speech_started": InputAudioBufferSpeechStartedEvent,
    "input_audio_buffer.speech_stopped": InputAudioBufferSpeechStoppedEvent,
    "error": ErrorEvent,
}


def validate(event: dict) -> None:
    """``event`` is what the openai package's type of its ``type`` accepts. Session events: the session object
    by the update event's session model (the beta ``TranscriptionSession`` model requires a ``client_secret``
    that OpenAI sends only from its REST route)."""
    kind = event["type"]
    if kind in ("transcription_session.created", "transcription_session.updated"):
        assert set(event) == {"type", "event_id", "session"}
        TranscriptionSessionConfig.model_validate(event["session"])
        assert event["session"]["object"] == "realtime.transcription_session"
    else:
        EVENT_TYPES[kind].model_validate(event)
    assert event["event_id"].startswith("event_")


@pytest.fixture(scope="module")
def sm(speech_cache):  # noqa: F811
    from specstream.stages.speech import SpeechModel

    return SpeechModel.load()


@pytest.fixture(scope="module")
def server(sm):
    from specstream.pipeline.server import ServerSettings
    from specstream.stages.streaming import SpeechService

    # passes at every hop position on both sides (the server and ``oracle``), so the transcripts compare exactly
    # whatever the machine's speed (the catch-up would move each side's positions with its own timing)
    srv = ServerThread(ServerSettings(port=free_port(), api_keys=[KEY], idle_timeout_s=30.0, min_hop_s=HOP_S,
                                      catch_up_s=None))
    srv.app.state.specstream.speech = SpeechService(sm, num_slots=4)
    yield srv.start()
    srv.stop()


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Two short sentences with a 1.2-s pause between them (a turn boundary for server_vad)."""
    return compose(tmp_path_factory.mktemp("rt"), (SCRIPT[5], SCRIPT[9]), [1.2, 0.8], lead_s=0.3)


@pytest.fixture(scope="module")
def oracle(sm):
    """``oracle(x16)``: the transcript the recognizer gives the 16 kHz samples ``x16`` (its finals, joined as the
    deltas are), from one speech service of its own."""
    from specstream.stages.streaming import SpeechService, StreamConfig, replay

    loop = asyncio.new_event_loop()
    svc = SpeechService(sm, num_slots=2)

    def run(x16: np.ndarray) -> str:
        res = loop.run_until_complete(replay(svc, x16, 0.5, StreamConfig(hop_s=HOP_S, catch_up_s=None), pace=None))
        return " ".join(s.text.strip() for s in res.finals if s.text.strip())

    yield run
    loop.run_until_complete(svc.stop())
    loop.close()


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def to_24k(x16: np.ndarray) -> np.ndarray:
    import av

    frame = av.AudioFrame.from_ndarray(x16.reshape(1, -1).astype(np.float32), format="flt", layout="mono")
    frame.sample_rate = 16000
    rs = av.AudioResampler(format="flt", layout="mono", rate=24000)
    out = [f.to_ndarray().reshape(-1) for f in [*rs.resample(frame), *rs.resample(None)]]
    return np.concatenate(out)


def server_samples(data: bytes, rate: int) -> np.ndarray:
    """The 16 kHz samples the server's decoder makes of ``data`` (pcm16 at ``rate``) and its flush."""
    from specstream.pipeline.subtitle_session import PcmDecoder

    dec = PcmDecoder(rate, "pcm_s16le")
    return np.concatenate([dec.decode(data), dec.flush()])


def chunks(data: bytes, n: int = 9600) -> list[str]:
    return [base64.b64encode(data[i:i + n]).decode() for i in range(0, len(data), n)]


# -- the official client -----------------------------------------------------------------------------------------
def _client_session(server, session: dict, data: bytes) -> list[dict]:
    """One item through ``client.beta.realtime.connect``: update, appends, commit; the events until completed."""
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY,
                           websocket_base_url=f"ws://127.0.0.1:{server.settings.port}/v1")
    events = []
    with client.beta.realtime.connect(model="whisper-1", extra_query={"intent": "transcription"}) as conn:
        first = json.loads(conn.recv_bytes())
        events.append(first)
        conn.transcription_session.update(session=session)
        for c in chunks(data):
            conn.input_audio_buffer.append(audio=c)
        conn.input_audio_buffer.commit()
        while events[-1]["type"] != "conversation.item.input_audio_transcription.completed":
            raw = conn.recv_bytes()
            conn.parse_event(raw)  # the client's own parser takes it
            events.append(json.loads(raw))
            assert events[-1]["type"] != "error", events[-1]
    return events


def test_official_client_transcribes_one_item_like_the_recognizer(server, oracle, two):
    """OpenAI's pcm16 (24 kHz) through the official client, committed by hand (the 16 kHz extension is driven
    by the tests below)."""
    x16, rate = two.audio[: int((two.spans[0][1] + 0.5) * 16000)], 24000
    data = pcm16(to_24k(x16))
    session = {"input_audio_format": "pcm16", "turn_detection": None,
               "input_audio_transcription": {"model": "whisper-1", "language": "en"}}
    events = _client_session(server, session, data)
    for e in events:
        validate(e)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["transcription_session.created", "transcription_session.updated"]
    assert events[1]["session"]["turn_detection"] is None
    assert events[1]["session"]["input_audio_sample_rate"] == rate
    (committed,) = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    assert committed["previous_item_id"] is None and committed["item_id"].startswith("item_")
    deltas = [e for e in events if e["type"].endswith(".delta")]
    done = events[-1]
    assert {e["item_id"] for e in deltas} == {done["item_id"]} == {committed["item_id"]}
    want = oracle(server_samples(data, rate))
    assert want  # speech was heard
    assert done["transcript"] == "".join(e["delta"] for e in deltas) == want
    assert done["usage"] == {"type": "duration", "seconds": round(len(server_samples(data, rate)) / 16000, 3)}


def test_server_vad_turns_cover_every_sample(server, oracle, two):
    """server_vad: two turns -> speech_started/stopped/committed per turn, item audio in order covering the
    stream (no sample dropped), each item transcribed as the recognizer transcribes that stretch."""
    from websockets.sync.client import connect

    x16 = two.audio
    data = pcm16(x16)
    with connect(f"ws://127.0.0.1:{server.settings.port}/v1/realtime?intent=transcription",
                 additional_headers={"Authorization": f"Bearer {KEY}"}, max_size=None) as ws:
        events = [json.loads(ws.recv())]
        ws.send(json.dumps({"type": "transcription_session.update", "session": {
            "input_audio_format": "pcm16", "input_audio_sample_rate": 16000,
            "turn_detection": {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                               "silence_duration_ms": 500}}}))
        for c in chunks(data, 8000):
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": c}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))  # the tail after the last turn
        done = 0
        while done < 3:
            events.append(json.loads(ws.recv(timeout=120)))
            done += events[-1]["type"].endswith(".completed")
    for e in events:
        validate(e)
    kinds = [e["type"] for e in events if not e["type"].endswith(".delta")]
    assert kinds[:2] == ["transcription_session.created", "transcription_session.updated"]
    turn = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed"]
    assert kinds[2:8] == turn + turn
    started = [e for e in events if e["type"].endswith("speech_started")]
    stopped = [e for e in events if e["type"].endswith("speech_stopped")]
    committed = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    for (a, b), s, t in zip(two.spans, started, stopped):
        assert abs(s["audio_start_ms"] / 1000 - max(0.0, a - 0.3)) < 0.15, (s, a)
        assert abs(t["audio_end_ms"] / 1000 - b) < 0.15, (t, b)
    assert [c["previous_item_id"] for c in committed] == [None, committed[0]["item_id"], committed[1]["item_id"]]
    assert [s["item_id"] for s in started] == [c["item_id"] for c in committed[:2]]
    completed = [e for e in events if e["type"].endswith(".completed")]
    assert [c["item_id"] for c in completed] == [c["item_id"] for c in committed]
    bounds = [0] + list(np.cumsum([round(c["usage"]["seconds"] * 16000) for c in completed[:2]]))
    assert bounds[1] % 512 == bounds[2] % 512 == 0  # turns end on VAD frames (so the seconds are exact)
    assert abs(bounds[2] + completed[2]["usage"]["seconds"] * 16000 - len(x16)) <= 8  # every sample in one item
    bounds.append(len(x16))
    got = [c["transcript"] for c in completed]
    want = [oracle(server_samples(data, 16000)[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert got == want
    assert got[0] and got[1] and got[2] == ""  # the tail after the second turn is silence


def test_appends_far_faster_than_real_time_are_backpressured_and_none_is_lost(server, oracle, two, monkeypatch):
    """A client appends a recording (two items, committed by hand) as fast as the socket takes it, in 0.1-s
    appends: the server leaves the socket unread while the items' backlog is at ``max_backlog_s`` (1.5 s here,
    patched into the session's config, which has no server setting; 30 s by default), so the backlog a spy on the
    session reads after every append is under the bound plus that append, and the backpressure metric grows.
    Nothing accepted is lost: each item's usage is exactly the audio appended to it, and its transcript is the
    recognizer's transcript of that stretch."""
    import httpx
    from websockets.asyncio.client import connect

    from live_fixtures import metric
    from specstream.pipeline.realtime import RealtimeTranscriptionSession

    bound_s, append_s = 1.5, 0.1
    open_stream, insert = RealtimeTranscriptionSession._open_stream, RealtimeTranscriptionSession._insert
    backlogs: list[float] = []  # the session's backlog (all items) after each insert
    inserted = [0]

    def small_bound(self):
        from dataclasses import replace

        self.config = replace(self.config, max_backlog_s=bound_s)
        return open_stream(self)

    def spy(self, x):
        insert(self, x)
        inserted[0] += len(x)
        backlogs.append(self._backlog_s())

    monkeypatch.setattr(RealtimeTranscriptionSession, "_open_stream", small_bound)
    monkeypatch.setattr(RealtimeTranscriptionSession, "_insert", spy)
    x16 = two.audio
    data = pcm16(x16)
    split = 2 * int((two.spans[0][1] + 0.6) * 16000)  # bytes of the first item: in the pause between sentences
    n = int(append_s * 16000) * 2
    items = [chunks(data[:split], n), chunks(data[split:], n)]
    headers = {"Authorization": f"Bearer {KEY}"}
    name = "specstream_subtitle_backpressure_seconds_total"
    waited0 = metric(httpx.get(server.base + "/metrics", headers=headers).text, name)

    async def main():
        events = []
        async with connect(f"ws://127.0.0.1:{server.settings.port}/v1/realtime?intent=transcription",
                           additional_headers=headers, max_size=None) as ws:
            async def reader():
                async for m in ws:
                    events.append(json.loads(m))
                    if sum(e["type"].endswith(".completed") for e in events) == 2:
                        return

            rt = asyncio.create_task(reader())
            await ws.send(json.dumps({"type": "transcription_session.update", "session": {
                "input_audio_format": "pcm16", "input_audio_sample_rate": 16000, "turn_detection": None}}))
            for appends in items:
                for c in appends:
                    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": c}))
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await asyncio.wait_for(rt, 120)
        return events

    events = asyncio.run(main())
    waited = metric(httpx.get(server.base + "/metrics", headers=headers).text, name) - waited0
    print(f"\nbackpressure: {len(two.audio) / 16000:.1f} s appended; backlog at most {max(backlogs):.2f} s (bound "
          f"{bound_s} s), the socket left unread for {waited:.1f} s")
    for e in events:
        validate(e)
    assert not [e for e in events if e["type"] == "error"], events
    # the bound held (and was reached: the socket was left unread, the client's appends waited in it)
    assert bound_s <= max(backlogs) < bound_s + append_s + 1e-6, max(backlogs)
    assert waited > 0
    # nothing accepted was lost: every appended sample is in its item, transcribed
    assert inserted[0] == len(data) // 2, (inserted[0], len(data) // 2)
    committed = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
    completed = [e for e in events if e["type"].endswith(".completed")]
    assert [c["item_id"] for c in completed] == committed and len(committed) == 2
    assert [c["usage"]["seconds"] for c in completed] == [round(split / 2 / 16000, 3),
                                                          round((len(data) - split) / 2 / 16000, 3)]
    got = [c["transcript"] for c in completed]
    want = [oracle(server_samples(data[:split], 16000)), oracle(server_samples(data[split:], 16000))]
    assert got == want and all(want)


# -- bad input ---------------------------------------------------------------------------------------------------
def test_bad_events_get_openai_errors_and_lose_no_accepted_audio_clear_drops_the_rest(server, oracle, two):
    from websockets.sync.client import connect

    x16 = two.audio[: int(2.5 * 16000)]
    data = pcm16(x16)
    good = chunks(data, 16000)
    limit = server.settings.realtime_max_append_bytes
    bad = [
        ("{not json", "invalid_json", None),
        ("[1, 2]", "invalid_event", "type"),
        (json.dumps({"type": "response.create"}), "invalid_value", "type"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": good[0], "event_id": "evt_early"}),
         "session_not_configured", None),
        (json.dumps({"type": "transcription_session.update", "session": {"input_audio_format": "g711_ulaw"}}),
         "unsupported_parameter", "session.input_audio_format"),
        (json.dumps({"type": "transcription_session.update", "session": {"voice": "alloy"}}),
         "unknown_parameter", "session.voice"),
        (json.dumps({"type": "transcription_session.update", "session": {
            "input_audio_transcription": {"model": "gpt-9"}}}), "invalid_value",
         "session.input_audio_transcription.model"),
        (json.dumps({"type": "transcription_session.update", "session": {
            "turn_detection": {"type": "server_vad", "threshold": 3}}}), "invalid_value",
         "session.turn_detection.threshold"),
    ]
    after_update = [
        (json.dumps({"type": "input_audio_buffer.append", "audio": "@@not base64@@"}), "invalid_audio", "audio"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01\x02\x03").decode()}),
         "invalid_audio", "audio"),
        (json.dumps({"type": "input_audio_buffer.append",
                     "audio": base64.b64encode(b"\0" * (limit + 2)).decode()}),
         "input_audio_buffer_append_too_large", "audio"),
        (b"\x00\x01", "invalid_event", None),
    ]
    with connect(f"ws://127.0.0.1:{server.settings.port}/v1/realtime?intent=transcription",
                 additional_headers={"Authorization": f"Bearer {KEY}"}, max_size=None) as ws:
        assert json.loads(ws.recv())["type"] == "transcription_session.created"
        errors = []
        for msg, code, param in bad:
            ws.send(msg)
            e = json.loads(ws.recv(timeout=10))
            validate(e)
            errors.append((e["error"]["code"], e["error"]["param"]))
            assert e["error"]["type"] == "invalid_request_error"
        assert errors == [(c, p) for _, c, p in bad]
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))  # nothing appended yet
        e = json.loads(ws.recv(timeout=10))
        validate(e)
        assert e["error"]["code"] == "input_audio_buffer_commit_empty"
        ws.send(json.dumps({"type": "transcription_session.update", "session": {
            "input_audio_format": "pcm16", "input_audio_sample_rate": 16000, "turn_detection": None}}))
        assert json.loads(ws.recv(timeout=10))["type"] == "transcription_session.updated"
        noise = np.random.default_rng(0).normal(0, 0.1, 8000).astype(np.float32)
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunks(pcm16(noise))[0]}))
        ws.send(json.dumps({"type": "input_audio_buffer.clear"}))  # the only audio ever discarded: asked for
        e = json.loads(ws.recv(timeout=10))
        validate(e)
        assert e["type"] == "input_audio_buffer.cleared"
        for i, c in enumerate(good):  # each good append followed by a bad one: the session goes on
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": c}))
            msg, code, param = after_update[i % len(after_update)]
            ws.send(msg)
            e = json.loads(ws.recv(timeout=10))
            validate(e)
            assert (e["error"]["code"], e["error"]["param"]) == (code, param)
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        events = []
        while not events or not events[-1]["type"].endswith(".completed"):
            events.append(json.loads(ws.recv(timeout=120)))
            validate(events[-1])
    assert [e["type"] for e in events if not e["type"].endswith(".delta")] == [
        "input_audio_buffer.committed", "conversation.item.input_audio_transcription.completed"]
    # every accepted sample and nothing else: the cleared noise and the refused appends are not in the item
    assert events[-1]["usage"]["seconds"] == round(len(x16) / 16000, 3)
    assert events[-1]["transcript"] == oracle(server_samples(data, 16000))


def test_auth_by_header_or_subprotocol_never_query(server):
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    url = f"ws://127.0.0.1:{server.settings.port}/v1/realtime?intent=transcription"
    for kw in ({}, {"additional_headers": {"Authorization": "Bearer wrong"}}):
        with connect(url.replace("?", f"?token={KEY}&") if not kw else url, **kw) as ws:
            with pytest.raises(ConnectionClosed) as exc:
                ws.recv(timeout=10)
            assert (exc.value.rcvd.code, exc.value.rcvd.reason) == (1008, "unauthorized")
    with connect(url, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}", "openai-beta.realtime-v1"]) as ws:
        assert ws.subprotocol == "realtime"
        assert json.loads(ws.recv(timeout=10))["type"] == "transcription_session.created"
    with connect(url.split("?")[0], additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        e = json.loads(ws.recv(timeout=10))
        validate(e)
        assert e["error"]["code"] == "unsupported_intent"
        with pytest.raises(ConnectionClosed) as exc:
            ws.recv(timeout=10)
        assert exc.value.rcvd.code == 1008


def test_key_subprotocol_masked_in_logs():
    import logging

    from specstream.pipeline.server import RedactSecrets

    rec = logging.LogRecord("uvicorn", logging.INFO, "", 0, "offered %s", ("openai-insecure-api-key.sk-abc123",),
                            None)
    RedactSecrets().filter(rec)
    assert rec.getMessage() == "offered openai-insecure-api-key.***"


# -- stream=true on /v1/audio/transcriptions ---------------------------------------------------------------------------
def test_transcription_stream_with_official_client(server, two):
    path = two.path
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    with open(path, "rb") as fh:
        plain = client.audio.transcriptions.create(model="whisper-1", file=fh).text
    with open(path, "rb") as fh:
        events = list(client.audio.transcriptions.create(model="whisper-1", file=fh, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["transcript.text.delta"] * (len(events) - 1) + ["transcript.text.done"] and len(events) > 1
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == plain
    assert plain
    with open(path, "rb") as fh, pytest.raises(openai.BadRequestError) as exc:
        client.audio.transcriptions.create(model="whisper-1", file=fh, stream=True, response_format="srt")
    assert exc.value.body["param"] == "stream"


def test_transcription_stream_sends_deltas_as_windows_are_decoded(server, sm, tmp_path):
    """More than 30 s of speech is two windows of Whisper's long-form: the first window's deltas arrive while the
    second is still to be decoded (a spy on the real model counts decoded windows; before, every delta came
    after the whole file)."""
    import httpx

    rec = compose(tmp_path, SCRIPT, [0.3] * len(SCRIPT), lead_s=0.3, name="long")
    decode, decoded = sm.decode, []

    def counting(*args, **kwargs):
        out = decode(*args, **kwargs)
        decoded.append(len(out))
        return out

    sm.decode = counting
    try:
        events, windows_at_first = [], None
        with open(rec.path, "rb") as fh, httpx.stream(
                "POST", server.base + "/v1/audio/transcriptions", headers={"Authorization": f"Bearer {KEY}"},
                data={"model": "whisper-1", "stream": "true"}, files={"file": ("long.wav", fh, "audio/wav")},
                timeout=300) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if windows_at_first is None:
                        windows_at_first = len(decoded)
    finally:
        del sm.decode
    assert [e["type"] for e in events] == ["transcript.text.delta"] * (len(events) - 1) + ["transcript.text.done"]
    assert "".join(e["delta"] for e in events[:-1]) == events[-1]["text"]
    assert len(decoded) >= 2 and windows_at_first < len(decoded), (windows_at_first, decoded)
