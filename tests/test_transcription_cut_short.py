"""A transcription whose decode is cut short is an error, never an empty success (issue 19, item 4).

The defect: under load, ``POST /v1/audio/transcriptions`` of a short WAV sometimes answered 200 with an empty
``text``. The path: when any device step raised, ``DeviceLoop._fail_all`` cancelled every request in flight, and
the cancellation resolved each request's future as a *finished* request (``finish_reason="cancelled"``, no error)
before the exception could be set; ``SpeechModel.decode`` took the cancelled window's partial output (nothing, or a
few tokens) as the window's hypothesis, so the route returned the empty or truncated text as a success. The loop
logged nothing, which is why the cause stayed hidden.

Load is made deterministic: the Whisper runner's step raises once, on its second forward (the first decode step
after the prefill), while the transcription is in flight."""

from __future__ import annotations

import logging

import openai
import pytest

from live_fixtures import ServerThread, free_port
from whisper_fixtures import speak, speech_cache  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(240)
KEY = "sk-cut-short"


class StepFailure(RuntimeError):
    """The injected failure of one device step."""


@pytest.fixture(scope="module")
def server(speech_cache, tmp_path_factory):
    from specstream.pipeline.server import ServerSettings

    srv = ServerThread(ServerSettings(port=free_port(), api_keys=[KEY])).start()
    yield srv
    srv.stop()


def test_decode_cut_short_by_a_failed_step_is_an_error_not_an_empty_text(server, tmp_path, monkeypatch, caplog):
    wav = speak("The red bicycle is parked next to the station.", tmp_path / "sentence.wav").read_bytes()
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def transcribe() -> str:
        return client.audio.transcriptions.create(model="whisper-1", file=("s.wav", wav, "audio/wav")).text

    full = transcribe()
    assert "parked next to" in full  # tiny.en's reading of the espeak-ng voice (the rest varies by voice)
    hub = server.app.state.specstream.openai.hub()
    executor = hub.loop.runner("whisper").executor
    real = executor.execute
    calls = {"n": 0}

    def execute(plan):
        if plan.prefills or plan.decodes:
            calls["n"] += 1
            if calls["n"] == 2:
                raise StepFailure("injected failure of one device step")
        return real(plan)

    monkeypatch.setattr(executor, "execute", execute)
    with caplog.at_level(logging.ERROR, logger="specstream.device_loop"):
        with pytest.raises(openai.InternalServerError) as err:
            transcribe()
    assert calls["n"] >= 2
    assert "injected failure" in str(err.value.body) or err.value.status_code == 500
    assert any("device step failed" in r.getMessage() and r.exc_info and r.exc_info[0] is StepFailure
               for r in caplog.records)
    monkeypatch.setattr(executor, "execute", real)
    assert transcribe() == full  # the loop goes on: the next request gets the whole text
