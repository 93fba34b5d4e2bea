"""The server loads its speech model once, even when two app lifespans overlap (a lifespan's cancelled load task
does not stop its worker thread; schemathesis and test clients start and stop lifespans back to back). Two loads at
once raced through transformers' lazy imports ("cannot import name 'WhisperConfig' from 'transformers'")."""

from __future__ import annotations

import asyncio
import threading
import time


def test_overlapping_loads_load_the_speech_model_once(monkeypatch):
    import specstream.pipeline.server as server
    import specstream.stages.streaming as streaming
    from specstream.pipeline.server import AppState, ServerSettings

    calls = []

    def slow_load(path, dtype="float32"):  # stands in for SpeechModel.load (seconds of imports and weights)
        calls.append(threading.get_ident())
        time.sleep(0.3)
        return "model"

    class FakeService:
        def __init__(self, model, num_slots, loop):
            self.model, self.loop = model, loop

        async def start(self):
            pass

    monkeypatch.setattr(server, "_load_speech_model", slow_load)
    monkeypatch.setattr(streaming, "SpeechService", FakeService)
    state = AppState(ServerSettings())
    threads = [threading.Thread(target=lambda: asyncio.run(state.load())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    state.loop.stop()
    assert len(calls) == 1 and state.ready and state.speech.model == "model"
