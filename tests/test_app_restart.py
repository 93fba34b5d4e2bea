"""An app whose lifespan ends while its speech model is still loading starts again cleanly: the one speech build
outlives the lifespan that began it and the next startup waits for it (before, the second startup built a second
service and failed: ``a model named 'whisper' is already in the device loop``, which is what broke
tests/test_api_fuzz.py after other modules had warmed the model caches). The OpenAI routes then reuse that Whisper
model instead of registering one of their own in the same loop."""

from __future__ import annotations

import asyncio
import time


def _wait_ready(client, tries: int = 600):
    for _ in range(tries):
        r = client.get("/readyz")
        if r.status_code == 200 or r.json()["status"] == "failed":
            return r
        time.sleep(0.2)
    return r


def test_lifespan_ended_during_the_speech_load_restarts_ready():
    from fastapi.testclient import TestClient

    from specstream.pipeline.server import ServerSettings, create_app

    app = create_app(ServerSettings())
    with TestClient(app):  # a startup and an immediate shutdown: the speech model is still loading
        pass
    with TestClient(app) as c:
        r = _wait_ready(c)
        assert r.status_code == 200, r.text
        assert r.json()["models"]["whisper"] == "ready"
        state = app.state.specstream
        assert list(state.loop.runners) == ["whisper"] and state.loop.failed == {}
        # the routes' hub gets the app's Whisper (no second copy, no second registration)
        hub = state.openai.hub()
        assert asyncio.run(hub.speech_model()) is state.speech.model
    with TestClient(app) as c:  # and once more: still the same service, nothing registered twice
        assert _wait_ready(c).status_code == 200
        assert list(app.state.specstream.loop.runners) == ["whisper"]
