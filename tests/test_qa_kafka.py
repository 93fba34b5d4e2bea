"""``specstream qa --broker``: the job shared by ``specstream worker`` processes through a real Kafka-compatible
broker (tansu, one per module; Apache Kafka when ``SPECSTREAM_KAFKA_BOOTSTRAP`` is set). The worker also serves
``transcribe`` and ``generate`` requests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from qa_fixtures import SENTENCE, silent_clip, talk_clip, write_manifest

pytest.importorskip("aiokafka")

from specstream.pipeline.kafka import KafkaSettings, create_topics  # noqa: E402
from specstream.pipeline.qa_job import QaOptions, run_qa  # noqa: E402
from specstream.pipeline.tansu import external_bootstrap, kafka_bootstrap as broker_bootstrap  # noqa: E402
from specstream.pipeline.worker import topic_specs  # noqa: E402


@pytest.fixture(scope="module")
def kafka_bootstrap():
    with broker_bootstrap(external_bootstrap()) as bootstrap:  # $SPECSTREAM_KAFKA_BOOTSTRAP, else a local tansu
        yield bootstrap


def settings_for(bootstrap: str, media_dir: Path) -> KafkaSettings:
    tag = uuid.uuid4().hex[:8]
    return KafkaSettings(bootstrap=bootstrap, group=f"qa-{tag}", partitions=4, session_timeout_ms=3000,
                         heartbeat_interval_ms=1000, commit_interval_s=0.2, drain_timeout_s=20,
                         allowed_roots=[media_dir], **{f"topic_{t}": f"{tag}.{t}" for t in (
                             "requests", "frames", "frame_tasks", "results", "dlq", "state")})


def env_of(s: KafkaSettings) -> dict[str, str]:
    env = dict(os.environ)
    for k, v in s.model_dump().items():
        if v is not None:
            env[f"SPECSTREAM_KAFKA_{k.upper()}"] = json.dumps([str(p) for p in v]) if isinstance(v, list) else str(v)
    return env


async def _requests_and_results(s: KafkaSettings, requests: list[dict], n: int, timeout_s: float) -> list[dict]:
    """Produce raw requests, read the results topic from the start until ``n`` final results came."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    p = AIOKafkaProducer(bootstrap_servers=s.bootstrap)
    await p.start()
    try:
        for r in requests:
            await p.send_and_wait(s.topic_requests, json.dumps(r).encode(), key=r["id"].encode())
    finally:
        await p.stop()
    c = AIOKafkaConsumer(bootstrap_servers=s.bootstrap, group_id=None, auto_offset_reset="earliest")
    await c.start()
    try:
        tps = [TopicPartition(s.topic_results, i) for i in range(s.partitions)]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        out, deadline = [], time.monotonic() + timeout_s
        while sum(1 for r in out if r["final"]) < n:
            assert time.monotonic() < deadline, f"timed out: {out}"
            for recs in (await c.getmany(timeout_ms=300)).values():
                out.extend(json.loads(r.value) for r in recs)
        return out
    finally:
        await c.stop()


def test_two_workers_share_the_job_every_question_once_also_after_a_sigkill(kafka_bootstrap, tmp_path):
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.serving import GenerationParams, HubConfig, ModelHub, Prompt, Turn

    media = tmp_path / "media"
    media.mkdir()
    talk, silent = talk_clip(media), silent_clip(media)
    qs = [{"id": f"q{i}", "text": t} for i, t in enumerate(["What is parked?", "What colour is it?", "Where?"])]
    entries = [{"id": f"{name}{k}", "video": str(path), "questions": qs}
               for k in range(3) for name, path in (("talk", talk), ("silent", silent))]
    manifest = write_manifest(tmp_path / "m.jsonl", entries)
    total = len(entries) * len(qs)
    # the embedded run is the reference: the same stage and models behind another broker
    target, draft = default_caption_models(quiet=True)
    hub = ModelHub(HubConfig(vlm=str(target), vlm_drafts=(str(draft),), vlm_name="specstream-tiny-llava"))
    ref = tmp_path / "ref.jsonl"
    asyncio.run(run_qa(str(manifest), str(ref), QaOptions(max_new_tokens=16), hub=hub))

    s = settings_for(kafka_bootstrap, media)
    asyncio.run(create_topics(s, topic_specs(s)))
    cmd = [sys.executable, "-m", "specstream", "worker", "--stages", "all", "--log-level", "WARNING"]
    workers = [subprocess.Popen(cmd, env=env_of(s)) for _ in range(2)]
    out = tmp_path / "answers.jsonl"
    try:
        # the worker serves transcribe and generate too
        got = asyncio.run(_requests_and_results(s, [
            {"id": "tr", "task": "transcribe", "source": {"uri": str(talk)}, "qos": "batch"},
            {"id": "gen", "task": "generate", "qos": "interactive", "params": {"prompt": "Hello", "max_new_tokens": 6}},
            {"id": "gen-img", "task": "generate", "source": {"uri": str(silent)}, "params": {"prompt": "Hi"}},
        ], 3, 180))
        res = {r["id"]: r for r in got}
        assert res["tr"]["status"] == "ok" and res["tr"]["output"]["text"] == SENTENCE
        assert res["tr"]["output"]["segments"][0]["text"] == SENTENCE and res["tr"]["output"]["has_audio"]
        want = asyncio.run(hub.generate(Prompt(turns=(Turn("user", ("Hello",)),)),
                                        GenerationParams(max_new_tokens=6)))
        assert res["gen"]["output"]["tokens"] == want.tokens and res["gen"]["output"]["text"] == want.text
        assert res["gen-img"]["error"]["code"] == "unsupported_media"  # generate takes an image, not a video

        async def job():
            task = asyncio.create_task(run_qa(str(manifest), str(out), QaOptions(max_new_tokens=16), kafka=s,
                                              timeout_s=120))
            killed = False
            while not task.done():
                if not killed and out.exists() and out.read_bytes().count(b"\n") >= 1:
                    workers[0].send_signal(signal.SIGKILL)  # mid-job: its requests go to the other worker
                    killed = True
                await asyncio.sleep(0.05)
            assert killed
            return await task

        summary = asyncio.run(job())
        topic = asyncio.run(_requests_and_results(s, [], 3 + len(entries), 30))
        assert sum(1 for r in topic if r["id"].startswith("qa-")) >= total  # repeats of redelivered work allowed
        assert workers[0].wait(10) == -signal.SIGKILL
        workers[1].send_signal(signal.SIGTERM)
        assert workers[1].wait(60) == 0
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    keys = Counter((r["id"], r["question_id"]) for r in rows)
    assert len(keys) == total and set(keys.values()) == {1}  # every question exactly once
    assert summary.answered == total and summary.failed == 0
    assert out.read_text() == ref.read_text()  # the same lines, in manifest order, as the embedded run
