"""The Kafka worker against a real broker: tansu (started here) or Apache Kafka (``SPECSTREAM_KAFKA_BOOTSTRAP``).

Every test uses its own topics and groups, waits for partition assignment instead of sleeping, and reads the
results topic from the beginning, so tests do not see each other's messages.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from media import clips

pytest.importorskip("aiokafka")

from specstream.pipeline.tansu import external_bootstrap, kafka_bootstrap as broker_bootstrap  # noqa: E402

from specstream.pipeline.kafka import KafkaSettings, OffsetTracker, create_topics  # noqa: E402
from specstream.pipeline.worker import topic_specs  # noqa: E402

MAX_NEW = 6


@pytest.fixture(scope="session")
def kafka_bootstrap():
    with broker_bootstrap(external_bootstrap()) as bootstrap:  # $SPECSTREAM_KAFKA_BOOTSTRAP, else a local tansu
        yield bootstrap


@pytest.fixture(scope="session")
def captioner():
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.caption import Captioner

    target, draft = default_caption_models(quiet=True)
    return Captioner(target, [str(draft)])


def image_dir() -> Path:
    import skimage

    return Path(skimage.__file__).parent / "data"


def images(n: int) -> list[str]:
    files = sorted(p for p in image_dir().iterdir() if p.suffix.lower() in (".png", ".jpg"))
    assert len(files) >= n
    return [str(p) for p in files[:n]]


def make_settings(bootstrap: str, tmp_path: Path, media_dir: Path | None = None, **over) -> KafkaSettings:
    tag = uuid.uuid4().hex[:8]
    base = dict(bootstrap=bootstrap, group=f"g-{tag}", partitions=3, session_timeout_ms=3000,
                heartbeat_interval_ms=1000, commit_interval_s=0.2, drain_timeout_s=60,
                allowed_roots=[image_dir(), tmp_path] + ([media_dir] if media_dir else []))
    base.update({f"topic_{t}": f"{tag}.{t}" for t in ("requests", "frames", "frame_tasks", "results", "dlq",
                                                       "state")})
    base.update(over)
    return KafkaSettings(**base)


def env_of(s: KafkaSettings) -> dict[str, str]:
    env = dict(os.environ)
    for k, v in s.model_dump().items():
        if v is None or k in ("draft",):
            continue
        env[f"SPECSTREAM_KAFKA_{k.upper()}"] = json.dumps([str(p) for p in v]) if isinstance(v, list) else str(v)
    return env


def request(rid: str, path: str, **params) -> bytes:
    return json.dumps({"id": rid, "task": "caption", "source": {"uri": path}, "qos": "batch",
                       "params": {"max_new_tokens": MAX_NEW, **params}}).encode()


async def produce(s: KafkaSettings, topic: str, messages: list[tuple[str | None, bytes, dict]]) -> None:
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(bootstrap_servers=s.bootstrap, max_request_size=s.max_message_bytes)
    await p.start()
    try:
        for key, value, headers in messages:
            await p.send_and_wait(topic, value, key=key.encode() if key else None,
                                  headers=[(k, str(v).encode()) for k, v in headers.items()])
    finally:
        await p.stop()


class Reader:
    """Reads a topic from the beginning (no group)."""

    def __init__(self, s: KafkaSettings, topic: str):
        self.s, self.topic = s, topic
        self.records = []

    async def __aenter__(self):
        from aiokafka import AIOKafkaConsumer, TopicPartition

        self.c = AIOKafkaConsumer(bootstrap_servers=self.s.bootstrap, group_id=None, auto_offset_reset="earliest")
        await self.c.start()
        parts = self.c.partitions_for_topic(self.topic) or (await self.c.topics() and
                                                            self.c.partitions_for_topic(self.topic))
        assert parts, f"topic {self.topic} does not exist"
        tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
        self.c.assign(tps)
        await self.c.seek_to_beginning(*tps)
        return self

    async def __aexit__(self, *exc):
        await self.c.stop()

    async def poll(self, timeout_ms: int = 300) -> list:
        batch = await self.c.getmany(timeout_ms=timeout_ms)
        new = [r for recs in batch.values() for r in recs]
        self.records.extend(new)
        return new

    def results(self) -> list[dict]:
        return [json.loads(r.value) for r in self.records]

    async def until(self, cond, timeout_s: float, what: str = "") -> None:
        deadline = time.monotonic() + timeout_s
        while not cond(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {len(self.records)} records")
            await self.poll()


def finals(r: Reader) -> set[str]:
    return {x["id"] for x in r.results() if x["final"]}


def by_id(results: list[dict]) -> dict[str, dict[int, dict]]:
    """id -> seq -> result; asserts that repeated (id, seq) results are identical."""
    out: dict[str, dict[int, dict]] = {}
    for x in results:
        seen = out.setdefault(x["id"], {})
        if x["seq"] in seen:
            assert seen[x["seq"]] == x, f"duplicate ({x['id']}, {x['seq']}) differs"
        seen[x["seq"]] = x
    return out


async def started(s: KafkaSettings, captioner):
    from specstream.pipeline.worker import start_worker

    w = await start_worker(s, captioner)
    await w.broker.wait_assigned(60)
    return w


# -- unit --------------------------------------------------------------------------------------------------------


def test_offset_tracker_commits_contiguous_run_only():
    t = OffsetTracker()
    for off in (5, 6, 8, 9):  # 7 absent (compacted / control record)
        t.add(off)
    t.finish(6)
    assert t.committable is None  # 5 still in flight
    t.finish(5)
    assert t.committable == 7
    t.finish(9)
    assert t.committable == 7
    t.finish(8)
    assert t.committable == 10 and t.pending == 0


def test_settings_from_env_and_flags(monkeypatch):
    from specstream.pipeline.worker import build_parser, settings_from_args

    monkeypatch.setenv("SPECSTREAM_KAFKA_GROUP", "from-env")
    monkeypatch.setenv("SPECSTREAM_KAFKA_ALLOWED_ROOTS", '["/data"]')
    monkeypatch.setenv("SPECSTREAM_KAFKA_SASL_MECHANISM", "PLAIN")
    s = settings_from_args(build_parser().parse_args(["--broker", "kafka://k1:9092,k2:9092", "--stages",
                                                      "caption"]))
    assert (s.bootstrap, s.group, s.stages, s.allowed_roots) == ("k1:9092,k2:9092", "from-env", "caption",
                                                                 [Path("/data")])
    assert s.client_kwargs()["sasl_mechanism"] == "PLAIN"


def test_message_schemas_in_docs_are_current():
    from specstream.pipeline.messages import json_schemas

    root = Path(__file__).parent.parent / "docs" / "schemas"
    for name, schema in json_schemas().items():
        assert json.loads((root / f"{name}.json").read_text()) == schema, f"regenerate docs/schemas/{name}.json"


# -- against the broker -------------------------------------------------------------------------------------------


def test_end_to_end_equals_embedded(kafka_bootstrap, captioner, tmp_path, tmp_path_factory):
    """20 images + 2 videos: every id answered, results equal the embedded pipeline's."""
    from specstream.pipeline.caption_job import run_caption_graph

    media = clips(tmp_path_factory)
    inputs = images(20) + [str(media["joined.mp4"]), str(media["xfade.mp4"])]
    summary = asyncio.run(run_caption_graph(inputs, captioner, io.StringIO(), "Describe this image.", MAX_NEW,
                                            None, None, qos="batch"))
    embedded: dict[str, list[dict]] = {}
    for rec in summary.records:
        embedded.setdefault(rec["source"], []).append(rec)
    s = make_settings(kafka_bootstrap, tmp_path, media["joined.mp4"].parent)

    async def run():
        w = await started(s, captioner)
        try:
            await produce(s, s.topic_requests, [(f"r{i}", request(f"r{i}", p), {}) for i, p in enumerate(inputs)])
            async with Reader(s, s.topic_results) as r:
                await r.until(lambda r: len(finals(r)) == len(inputs), 240, "all final results")
                return r.results()
        finally:
            assert await w.stop()

    got = by_id(asyncio.run(run()))
    assert set(got) == {f"r{i}" for i in range(len(inputs))}
    for i, path in enumerate(inputs):
        seqs = got[f"r{i}"]
        assert sorted(seqs) == list(range(len(seqs)))
        assert [seqs[k]["final"] for k in sorted(seqs)] == [False] * (len(seqs) - 1) + [True]
        assert all(x["status"] == "ok" for x in seqs.values()), seqs
        assert [seqs[k]["output"] for k in sorted(seqs)] == embedded[path], path
    assert len(got["r20"]) >= 2 and len(got["r21"]) >= 2  # videos: one result per keyframe


def test_poison_messages_dlq_and_error_results(kafka_bootstrap, captioner, tmp_path):
    s = make_settings(kafka_bootstrap, tmp_path)
    outside = tmp_path.parent / "outside.png"
    outside.write_bytes(Path(images(1)[0]).read_bytes())
    (tmp_path / "fake.png").write_text("not an image")
    bad = {
        "not-json": (None, b"\xff\x00 definitely not json", "not JSON"),
        "no-id": (None, json.dumps({"task": "caption", "source": {"uri": "/x.png"}}).encode(), "no usable 'id'"),
        "empty-id": ("k", json.dumps({"id": "", "source": {"uri": "/x.png"}}).encode(), "no usable 'id'"),
    }
    errors = {
        "schema": (json.dumps({"id": "schema", "source": {}}).encode(), "schema_violation"),
        "params": (json.dumps({"id": "params", "source": {"uri": images(1)[0]},
                               "params": {"max_new_tokens": "many"}}).encode(), "schema_violation"),
        "unknown-task": (json.dumps({"id": "unknown-task", "task": "translate", "source": {"uri": "/x"}}).encode(),
                         "unsupported_task"),
        # a served task (the QA stage answers transcribe), refused for its source outside the allowed roots
        "transcribe": (json.dumps({"id": "transcribe", "task": "transcribe", "source": {"uri": "/x"}}).encode(),
                       "unreadable_source"),
        "missing": (request("missing", str(tmp_path / "nope.png")), "unreadable_source"),
        "outside": (request("outside", str(outside)), "unreadable_source"),
        "traversal": (request("traversal", str(tmp_path / ".." / "outside.png")), "unreadable_source"),
        "fake": (request("fake", str(tmp_path / "fake.png")), "unsupported_media"),
    }

    async def run():
        w = await started(s, captioner)
        try:
            msgs = [(k, v, {"origin": name}) for name, (k, v, _) in bad.items()]
            msgs += [(rid, v, {}) for rid, (v, _) in errors.items()]
            msgs.append(("good", request("good", images(1)[0]), {}))
            await produce(s, s.topic_requests, msgs)
            async with Reader(s, s.topic_results) as r, Reader(s, s.topic_dlq) as d:
                await r.until(lambda r: len(finals(r)) == len(errors) + 1, 120, "error results")
                await d.until(lambda d: len(d.records) >= len(bad), 60, "DLQ records")
                return r.results(), d.records
        finally:
            await w.stop()

    results, dlq = asyncio.run(run())
    got = {x["id"]: x for x in results}
    assert got["good"]["status"] == "ok"
    for rid, (_, code) in errors.items():
        assert (got[rid]["status"], got[rid]["error"]["code"], got[rid]["final"]) == ("error", code, True), got[rid]
    assert len(dlq) == len(bad)
    for rec in dlq:
        h = {k: v.decode() for k, v in rec.headers}
        key, value, reason = bad[h["origin"]]
        assert rec.value == value and h["dlq.topic"] == s.topic_requests and reason in h["dlq.reason"]
        assert int(h["dlq.offset"]) >= 0 and int(h["dlq.partition"]) >= 0


def test_slow_request_no_rebalance_loop(kafka_bootstrap, captioner, tmp_path):
    """max_poll_interval_ms=5000 and a request that takes 7 s: answered once, no rebalance."""
    s = make_settings(kafka_bootstrap, tmp_path, max_poll_interval_ms=5000)
    slow_until = [0.0]
    real_prepare = captioner.vlm.prepare

    def slow_prepare(image, prompt):
        if slow_until[0] == 0.0:
            slow_until[0] = time.monotonic() + 7.0
            time.sleep(7.0)  # in the caption stage's worker thread, like a slow encode would be
        return real_prepare(image, prompt)

    async def run():
        w = await started(s, captioner)
        gens = {g: c.generations for g, c in w.broker.groups.items()}
        try:
            await produce(s, s.topic_requests, [("slow", request("slow", images(1)[0]), {})])
            async with Reader(s, s.topic_results) as r:
                await r.until(lambda r: "slow" in finals(r), 60, "the slow result")
                t_end = time.monotonic() + 2.0
                while time.monotonic() < t_end:  # a redelivery would show up now
                    await r.poll()
                return r.results(), gens, {g: c.generations for g, c in w.broker.groups.items()}
        finally:
            await w.stop()

    captioner.vlm.prepare = slow_prepare
    try:
        results, before, after = asyncio.run(run())
    finally:
        captioner.vlm.prepare = real_prepare
    assert slow_until[0] > 0
    assert [(x["id"], x["seq"]) for x in results] == [("slow", 0)]
    assert before == after  # no rebalance


def test_two_workers_one_stops(kafka_bootstrap, captioner, tmp_path):
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.caption import Captioner

    target, draft = default_caption_models(quiet=True)
    other = Captioner(target, [str(draft)])
    s = make_settings(kafka_bootstrap, tmp_path)
    paths = images(12)

    async def run():
        a = await started(s, captioner)
        b = await started(s, other)
        ga = a.broker.group_of(s.topic_frame_tasks)
        while not ga.consumer.assignment() or ga.generations < 2:  # b's join reached a
            await asyncio.sleep(0.05)
        await b.broker.wait_assigned()
        share_a = {(tp.topic, tp.partition) for tp in a.broker.group_of(s.topic_requests).consumer.assignment()}
        share_b = {(tp.topic, tp.partition) for tp in b.broker.group_of(s.topic_requests).consumer.assignment()}
        try:
            await produce(s, s.topic_requests, [(f"r{i}", request(f"r{i}", p), {}) for i, p in enumerate(paths)])
            async with Reader(s, s.topic_results) as r:
                await r.until(lambda r: len(finals(r)) >= 2, 120, "first results")
                assert await a.stop()  # graceful: a drains and leaves; b takes over its partitions
                await r.until(lambda r: len(finals(r)) == len(paths), 180, "all results after a stopped")
                return share_a, share_b, r.results()
        finally:
            await b.stop()

    share_a, share_b, results = asyncio.run(run())
    assert share_a and share_b and not share_a & share_b
    got = by_id(results)
    assert set(got) == {f"r{i}" for i in range(len(paths))}


def test_sigkill_and_restart_loses_nothing(kafka_bootstrap, tmp_path, tmp_path_factory):
    media = clips(tmp_path_factory)
    s = make_settings(kafka_bootstrap, tmp_path, media["joined.mp4"].parent, max_in_flight=4)
    inputs = images(8) + [str(media["joined.mp4"])]
    env = env_of(s)
    cmd = [sys.executable, "-m", "specstream", "worker", "--log-level", "WARNING"]

    async def run():
        await create_topics(s, topic_specs(s))  # the requests go in before any worker ran
        await produce(s, s.topic_requests, [(f"r{i}", request(f"r{i}", p, max_new_tokens=16), {})
                                            for i, p in enumerate(inputs)])
        first = subprocess.Popen(cmd, env=env)
        try:
            async with Reader(s, s.topic_results) as r:
                await r.until(lambda r: len(r.records) >= 3, 120, "first results")
                first.send_signal(signal.SIGKILL)
                first.wait(10)
                seen = len(r.records)
                second = subprocess.Popen(cmd, env=env)
                try:
                    await r.until(lambda r: len(finals(r)) == len(inputs), 180, "all results after restart")
                    second.send_signal(signal.SIGTERM)
                    assert second.wait(60) == 0
                finally:
                    if second.poll() is None:
                        second.kill()
                await r.poll(500)
                return seen, r.results()
        finally:
            if first.poll() is None:
                first.kill()

    seen, results = asyncio.run(run())
    got = by_id(results)  # duplicates only as identical (id, seq) repeats
    assert set(got) == {f"r{i}" for i in range(len(inputs))}
    for seqs in got.values():
        assert sorted(seqs) == list(range(len(seqs))) and seqs[max(seqs)]["final"]
    assert seen < len(results)


def _stream_frames(path: Path) -> list[tuple[float, bytes]]:
    import av
    from PIL import Image

    out = []
    with av.open(str(path)) as c:
        for f in c.decode(video=0):
            buf = io.BytesIO()
            Image.fromarray(f.to_ndarray(format="rgb24")).save(buf, format="JPEG", quality=85)
            out.append((float(f.time), buf.getvalue()))
    return out


def test_live_stream_survives_restart(kafka_bootstrap, captioner, tmp_path, tmp_path_factory):
    """A live stream (JPEG frames with stream_id/pts headers): keyframe results as it plays, numbered across a
    worker restart exactly as one uninterrupted selector numbers them."""
    from specstream.stages.keyframes import KeyframeSelector
    from specstream.pipeline.live import decode_image_bytes, proxy

    frames = _stream_frames(clips(tmp_path_factory)["joined.mp4"])
    sel = KeyframeSelector()
    expected = []
    for i, (pts, data) in enumerate(frames):
        expected += [(k.frame_index, round(k.timestamp_s, 6)) for k in sel.push(i, pts, proxy(decode_image_bytes(data), 64))]
    assert len(expected) >= 2
    assert len(json.dumps(sel.state_dict())) < 4096
    s = make_settings(kafka_bootstrap, tmp_path, partitions=1)
    half = len(frames) // 2
    msgs = [("cam-1", data, {"stream_id": "cam-1", "pts": f"{pts:.6f}"}) for pts, data in frames]

    async def run():
        w = await started(s, captioner)
        await produce(s, s.topic_frames, msgs[:half] + [(None, b"\xff\xd8junk", {"pts": "0"})])
        while w.stages["live"].frames < half:
            await asyncio.sleep(0.1)
        await w.stop()
        w = await started(s, captioner)
        try:
            await produce(s, s.topic_frames, msgs[half:])
            async with Reader(s, s.topic_results) as r, Reader(s, s.topic_dlq) as d:
                await r.until(lambda r: len({x["seq"] for x in r.results()}) >= len(expected), 120, "keyframes")
                await d.until(lambda d: len(d.records) >= 1, 30, "the frame without stream id")
                t_end = time.monotonic() + 1.0
                while time.monotonic() < t_end:
                    await r.poll()
                    await d.poll()
                # at-least-once: the junk frame's offset may not be committed before the restart (frames before
                # it are still held by the stream), so it can be dead-lettered again; every copy names it
                sources = {(dict(x.headers)["dlq.partition"], dict(x.headers)["dlq.offset"]) for x in d.records}
                assert sources == {(b"0", str(half).encode())}, sources
                return r.results()
        finally:
            await w.stop()

    got = by_id(asyncio.run(run()))["cam-1"]
    assert sorted(got) == list(range(len(expected)))
    assert not any(x["final"] for x in got.values())
    assert [(got[k]["output"]["frame_index"], got[k]["output"]["timestamp_s"]) for k in sorted(got)] == expected


async def committed(s: KafkaSettings, group: str, topic: str) -> dict[int, int]:
    """The committed offsets of ``group`` on ``topic`` (partition -> offset; absent: nothing committed)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    c = AIOKafkaConsumer(bootstrap_servers=s.bootstrap, group_id=group, enable_auto_commit=False)
    await c.start()
    try:
        parts = c.partitions_for_topic(topic) or (await c.topics() and c.partitions_for_topic(topic)) or set()
        out = {}
        for p in sorted(parts):
            off = await c.committed(TopicPartition(topic, p))
            if off is not None and off >= 0:
                out[p] = off
        return out
    finally:
        await c.stop()


async def until_committed(s: KafkaSettings, group: str, topic: str, want: dict[int, int], timeout_s: float = 20):
    deadline = time.monotonic() + timeout_s
    while (got := await committed(s, group, topic)) != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"{group} on {topic}: committed {got}, expected {want}")
        await asyncio.sleep(0.2)


def test_long_prompt_inline_media_and_oversized_poison(kafka_bootstrap, captioner, tmp_path, tmp_path_factory):
    """Through Kafka: a prompt longer than the context gets its error result before its offsets are committed
    (before: no result, offset committed); inline PNG and MP4 bytes without a filename are recognised by content
    (before: ``unsupported_media ... '.bin'``); a non-JSON message just under the size limit goes to the DLQ
    truncated, with the whole payload's SHA-256 and length; our producer refuses a message over the limit."""
    import base64
    import hashlib

    limit = 1 << 20
    s = make_settings(kafka_bootstrap, tmp_path, partitions=1, max_message_bytes=limit)
    from PIL import Image

    png = tmp_path / "small.png"
    Image.open(images(1)[0]).convert("RGB").resize((96, 96)).save(png)
    mp4 = clips(tmp_path_factory)["short.mp4"]
    poison = bytes(np.random.default_rng(7).integers(0, 256, limit - 100, dtype=np.uint8))  # fits, barely
    inline = lambda rid, path: json.dumps({"id": rid, "source": {"data_b64": base64.b64encode(  # noqa: E731
        path.read_bytes()).decode()}, "params": {"max_new_tokens": MAX_NEW}}).encode()
    reqs = [("long", request("long", str(png), prompt=" ".join(["word"] * 1000))),
            ("inline-png", inline("inline-png", png)), ("inline-mp4", inline("inline-mp4", mp4)),
            (None, poison)]

    async def run():
        w = await started(s, captioner)
        try:
            await produce(s, s.topic_requests, [(k, v, {}) for k, v in reqs])
            async with Reader(s, s.topic_results) as r, Reader(s, s.topic_dlq) as d:
                await r.until(lambda r: len(finals(r)) == 3, 120, "final results")
                await d.until(lambda d: len(d.records) == 1, 30, "the DLQ copy")
                await until_committed(s, f"{s.group}.keyframes", s.topic_requests, {0: 4})
                n_tasks = sum(1 for x in r.results() if x["id"].startswith(("long", "inline")))
                await until_committed(s, f"{s.group}.caption", s.topic_frame_tasks, {0: n_tasks})
                from specstream.errors import MessageTooLargeError

                with pytest.raises(MessageTooLargeError, match=f"over the limit of {limit} bytes"):
                    await w.broker.publish_raw("specstream.requests", "big", b"x" * limit)
                async with Reader(s, s.topic_requests) as q:
                    await q.until(lambda q: len(q.records) == 4, 10, "requests")
                    await q.poll(300)
                    sent = q.records
                return r.results(), d.records[0], sent
        finally:
            assert await w.stop()

    results, dlq, sent = asyncio.run(run())
    assert len(sent) == 4  # the oversized message was refused unsent
    got = by_id(results)
    (long,) = got["long"].values()
    assert (long["status"], long["error"]["code"], long["final"]) == ("error", "context_length_exceeded", True)
    png_out = got["inline-png"][0]
    assert (png_out["status"], png_out["output"]["kind"], png_out["output"]["source"]) == ("ok", "image",
                                                                                             "inline:inline-png")
    assert all(x["status"] == "ok" and x["output"]["kind"] == "video" for x in got["inline-mp4"].values())
    h = {k: v.decode() for k, v in dlq.headers}
    assert h["dlq.sha256"] == hashlib.sha256(poison).hexdigest() and h["dlq.original_bytes"] == str(len(poison))
    assert h["dlq.truncated"] == "true" and "not JSON" in h["dlq.reason"]
    assert 0 < len(dlq.value) < len(poison) and dlq.value == poison[: len(dlq.value)]
    from specstream.pipeline.kafka import record_size

    assert record_size(None, dlq.value, [(k, v) for k, v in dlq.headers]) <= limit


def test_drain_timeout_leaves_work_uncommitted_for_redelivery(kafka_bootstrap, captioner, tmp_path, caplog):
    """``drain_timeout_s=2`` with a frame stuck in preprocessing: the worker stops within the timeout plus
    the time to commit and leave (before: it waited for the frame), without committing the frame; a poison
    message whose DLQ copy fails is not committed either. A second worker gets both again and answers them."""
    import threading

    s = make_settings(kafka_bootstrap, tmp_path, partitions=1, drain_timeout_s=2)
    release = threading.Event()
    stuck = []
    real_prepare = captioner.vlm.prepare

    def prepare(image, prompt):
        if not stuck:
            stuck.append(time.monotonic())
            release.wait(60)  # a frame that is not done when the drain times out
        return real_prepare(image, prompt)

    async def run():
        w = await started(s, captioner)
        real_publish = w.broker.publish_raw

        async def refuse_dlq(topic, key, data, headers=None):
            if topic == s.topic_dlq:
                raise RuntimeError("DLQ unavailable")
            await real_publish(topic, key, data, headers)

        w.broker.publish_raw = refuse_dlq
        captioner.vlm.prepare = prepare
        try:
            await produce(s, s.topic_requests, [("stuck", request("stuck", images(1)[0]), {}),
                                                (None, b"\x00 not json", {})])
            async with Reader(s, s.topic_frame_tasks) as f:
                await f.until(lambda f: len(f.records) == 1 and stuck, 60, "the stuck frame")
            t0 = time.monotonic()
            drained = await w.stop()
            stop_s = time.monotonic() - t0
        finally:
            captioner.vlm.prepare = real_prepare
        assert await committed(s, f"{s.group}.caption", s.topic_frame_tasks) == {}
        assert await committed(s, f"{s.group}.keyframes", s.topic_requests) == {0: 1}  # the poison: not
        w2 = await started(s, captioner)
        try:
            async with Reader(s, s.topic_results) as r, Reader(s, s.topic_dlq) as d:
                await r.until(lambda r: "stuck" in finals(r), 60, "the redelivered frame's result")
                await d.until(lambda d: len(d.records) == 1, 30, "the redelivered poison's DLQ copy")
                await until_committed(s, f"{s.group}.keyframes", s.topic_requests, {0: 2})
                await until_committed(s, f"{s.group}.caption", s.topic_frame_tasks, {0: 1})
                return drained, stop_s, r.results()
        finally:
            release.set()
            assert await w2.stop()

    caplog.set_level("WARNING", "specstream.kafka")
    drained, stop_s, results = asyncio.run(run())
    assert not drained and stop_s < 2 + 4, stop_s
    assert "1 message still in flight after 2 s: left uncommitted" in caplog.text
    assert [(x["id"], x["seq"], x["status"]) for x in results] == [("stuck", 0, "ok")]
