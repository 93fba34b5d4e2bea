"""Parity: the CLI (stages called directly), the HTTP server and the Kafka worker give the same records.

The same small inputs go through each path's real code: ``specstream caption`` / ``qa`` / ``transcribe`` run
in process through :func:`specstream.cli.main`; the HTTP routes through FastAPI's ``TestClient`` on
:func:`~specstream.pipeline.server.create_app` (``POST /v1/captions``, ``POST /v1/audio/transcriptions``); the
worker through :func:`~specstream.pipeline.worker.start_worker` on a real broker (tansu, started here; Apache
Kafka when ``SPECSTREAM_KAFKA_BOOTSTRAP`` is set). Models: the built-in tiny VLM pair (untrained, greedy) and
Whisper tiny.en (real weights). The HTTP server has no video-QA route, so ``qa`` is compared CLI vs worker only.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

pytest.importorskip("aiokafka")

from qa_fixtures import SENTENCE, talk_clip, write_manifest  # noqa: E402
from test_kafka import Reader, by_id, make_settings, produce  # noqa: E402

from specstream.pipeline.tansu import external_bootstrap, kafka_bootstrap as broker_bootstrap  # noqa: E402

MAX_NEW = 6


@pytest.fixture(scope="module")
def kafka_bootstrap():
    with broker_bootstrap(external_bootstrap()) as bootstrap:  # $SPECSTREAM_KAFKA_BOOTSTRAP, else a local tansu
        yield bootstrap


@pytest.fixture(scope="module")
def media(tmp_path_factory, clips, src):
    """One folder: an image, a video of three scenes and a 3-s clip with a spoken sentence."""
    d = tmp_path_factory.mktemp("parity")
    shutil.copy(src["astronaut"], d / "astronaut.png")
    shutil.copy(clips["joined.mp4"], d / "joined.mp4")
    talk = talk_clip(d)
    return {"dir": d, "image": str(d / "astronaut.png"), "video": str(d / "joined.mp4"), "talk": str(talk)}


@pytest.fixture(scope="module")
def http(media):
    """A TestClient of the app (lifespan run: Whisper loaded; the captioner on the first caption)."""
    from fastapi.testclient import TestClient

    from specstream.pipeline.server import ServerSettings, create_app

    with TestClient(create_app(ServerSettings(allowed_roots=[media["dir"]]))) as client:
        yield client


@pytest.fixture
def worker_captioner():
    """The worker's captioner, as ``specstream worker`` builds it by default (the tiny target and its draft): one
    per test, as one per worker process (a worker's hub adds its Whisper runner to the captioner's loop)."""
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.caption import Captioner

    target, draft = default_caption_models(quiet=True)
    captioner = Captioner(target, [str(draft)])
    yield captioner
    captioner.loop.stop()


def run_worker(bootstrap, tmp_path, media_dir, captioner, work):
    """Start an in-process worker (``--stages all``: keyframes, caption and QA) and run ``await work(settings)``."""
    from specstream.pipeline.worker import start_worker

    s = make_settings(bootstrap, tmp_path, media_dir, stages="all")

    async def go():
        w = await start_worker(s, captioner)
        try:
            await w.broker.wait_assigned(60)
            return await work(s)
        finally:
            assert await w.stop()

    return asyncio.run(go())


def worker_results(bootstrap, tmp_path, media_dir, captioner, requests: list[dict]) -> dict[str, dict[int, dict]]:
    """Results of raw requests on the worker: id -> seq -> result."""

    async def work(s):
        await produce(s, s.topic_requests, [(r["id"], json.dumps(r).encode(), {}) for r in requests])
        async with Reader(s, s.topic_results) as reader:
            want = {r["id"] for r in requests}
            await reader.until(lambda rd: want <= {x["id"] for x in rd.results() if x["final"]}, 240, "finals")
            return reader.results()

    return by_id(run_worker(bootstrap, tmp_path, media_dir, captioner, work))


def test_caption_records_are_identical_on_cli_http_and_worker(media, http, kafka_bootstrap, worker_captioner,
                                                              tmp_path):
    from specstream.cli import main

    inputs = [media["image"], media["video"]]
    out = tmp_path / "cli.jsonl"
    assert main(["caption", *inputs, "--out", str(out), "--max-new-tokens", str(MAX_NEW), "--no-progress"]) == 0
    cli = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in cli] == ["image"] + ["video"] * 3, cli  # the video's three scenes
    assert all("caption" in r and r["tokens"] for r in cli)

    web = []
    for path in inputs:
        r = http.post("/v1/captions", data={"source_uri": path, "max_new_tokens": str(MAX_NEW)})
        assert r.status_code == 200, r.text
        web.extend(r.json()["records"])

    got = worker_results(kafka_bootstrap, tmp_path, media["dir"], worker_captioner, [
        {"id": f"c{i}", "task": "caption", "source": {"uri": p}, "qos": "batch",
         "params": {"max_new_tokens": MAX_NEW}} for i, p in enumerate(inputs)])
    assert all(x["status"] == "ok" for seqs in got.values() for x in seqs.values()), got
    worker = [got[f"c{i}"][k]["output"] for i in range(len(inputs)) for k in sorted(got[f"c{i}"])]

    # every field: source, kind, frame_index, timestamp_s (PTS), caption text, token ids, scene score, stats
    assert web == cli
    assert worker == cli


def test_qa_answer_lines_are_identical_on_cli_and_worker(media, kafka_bootstrap, worker_captioner, tmp_path):
    """The HTTP server has no video-QA route: CLI (QaStage called directly) vs ``specstream qa --broker`` with a
    worker answering (the same collecting code, ``run_qa(kafka=...)``)."""
    from specstream.cli import main
    from specstream.pipeline.qa_job import QaOptions, run_qa

    qs = [{"id": "q0", "text": "What is parked?"}, {"id": "q1", "text": "What colour is it?"}]
    manifest = write_manifest(tmp_path / "m.jsonl", [{"id": "talk", "video": media["talk"], "questions": qs}])
    out = tmp_path / "cli.jsonl"
    assert main(["qa", str(manifest), "--out", str(out), "--max-new-tokens", str(MAX_NEW), "--no-progress"]) == 0
    cli = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["question_id"] for r in cli] == ["q0", "q1"] and all(r["transcript_used"] for r in cli), cli

    wout = tmp_path / "worker.jsonl"

    async def work(s):
        return await run_qa(str(manifest), str(wout), QaOptions(max_new_tokens=MAX_NEW), kafka=s, timeout_s=120)

    summary = run_worker(kafka_bootstrap, tmp_path, media["dir"], worker_captioner, work)
    assert summary.answered == 2 and summary.failed == 0
    worker = [json.loads(line) for line in wout.read_text().splitlines()]
    # answer text, token ids, the frames shown (PTS seconds, frame numbers), transcript use and the stats
    assert worker == cli


def test_transcripts_are_identical_on_cli_http_and_worker(media, http, kafka_bootstrap, worker_captioner,
                                                          tmp_path):
    from specstream.cli import main

    out = tmp_path / "cli.jsonl"
    assert main(["transcribe", media["talk"], "--format", "jsonl", "-o", str(out)]) == 0
    cli = [json.loads(line) for line in out.read_text().splitlines()]
    assert [s["text"] for s in cli] == [SENTENCE], cli

    with open(media["talk"], "rb") as fh:
        r = http.post("/v1/audio/transcriptions", files={"file": ("talk.mp4", fh, "video/mp4")},
                      data={"model": "whisper-1", "response_format": "verbose_json"})
    assert r.status_code == 200, r.text
    web = r.json()["segments"]

    got = worker_results(kafka_bootstrap, tmp_path, media["dir"], worker_captioner, [
        {"id": "tr", "task": "transcribe", "source": {"uri": media["talk"]}, "qos": "batch"}])
    (res,) = got["tr"].values()
    assert res["status"] == "ok", res
    worker = res["output"]["segments"]

    # segment text and times (the HTTP and worker records round times to the millisecond; no token ids there)
    want = [(round(s["start_s"], 3), round(s["end_s"], 3), s["text"].strip()) for s in cli]
    assert [(s["start"], s["end"], s["text"]) for s in web] == want
    assert [(s["start_s"], s["end_s"], s["text"]) for s in worker] == want
    assert res["output"]["text"] == r.json()["text"] == " ".join(s["text"] for s in cli).strip()
