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


def test_runner_added_while_the_device_thread_ends_is_not_lost():
    """A model that finishes loading while the loop stops (the app's shutdown): its runner is added inline once the
    device thread took its last work, instead of waiting forever for a thread that has ended."""
    import threading

    from specstream.stages.device_loop import DeviceLoop

    runner = _tiny_runner()
    go, done = threading.Event(), threading.Event()

    def late_add():
        go.wait()
        loop.add_runner(runner)
        done.set()

    # the adding thread exists before the device thread, so the two never share an ident (a thread's ident is
    # reused once it ended: a thread started later could pass for the device thread and add inline)
    t = threading.Thread(target=late_add, daemon=True)
    t.start()
    loop = DeviceLoop([], device="cpu")
    loop.start()
    thread = loop._thread
    with loop._lock:  # what stop() does, without forgetting the thread (the window a late add_runner can hit)
        loop._stopping = True
        loop._lock.notify()
    thread.join(10)
    assert not thread.is_alive()
    go.set()
    assert done.wait(10), "add_runner waited for a device thread that had ended"
    assert "late" in loop.runners


def _tiny_runner():
    import tempfile
    from pathlib import Path

    from specstream.stages.device_loop import ModelRunner
    from specstream.stages.speculative.executor import SpeculativeExecutor
    from specstream.stages.speculative.models.checkpoint import resolve_checkpoint
    from specstream.stages.speculative.models.loader import load_decoder
    from specstream.stages.speculative.models.tiny import TinyDecoderSpec, build_tiny_decoder

    path = build_tiny_decoder(Path(tempfile.mkdtemp()) / "t", TinyDecoderSpec(vocab_size=64), seed=3)
    dec = load_decoder(resolve_checkpoint(str(path)), "float32", "cpu")
    return ModelRunner("late", SpeculativeExecutor(dec, [], 2, 32), max_len=32)


def test_a_failed_speech_load_is_retried_by_the_next_startup(monkeypatch):
    """A transient load failure (here the first load raises OSError) fails /readyz for that lifespan only: the next
    startup loads again and is ready. Before, the failed build was kept for the app's life and every later startup
    re-raised its error without loading."""
    from fastapi.testclient import TestClient

    import specstream.pipeline.server as server
    from specstream.pipeline.server import ServerSettings, create_app

    real, calls = server._load_speech_model, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("No space left on device (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(server, "_load_speech_model", flaky)
    app = create_app(ServerSettings())
    with TestClient(app) as c:
        r = _wait_ready(c)
        assert r.status_code == 503 and "No space left on device" in r.text, r.text
    with TestClient(app) as c:
        r = _wait_ready(c)
        assert r.status_code == 200, r.text
        assert r.json()["models"]["whisper"] == "ready"
    assert len(calls) == 2
