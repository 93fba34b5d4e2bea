"""Every exception raised while one input is handled ends as that input's error record, in every stage.

A failure is injected at each await point of the keyframe stage, the caption stage and the live keyframe stage
(the awaited call raises once); the test checks the records the stage published (numbering, ``final``/``last``,
the error's code), that every message was acknowledged exactly once and only after its last record was
published, and that nothing hangs (a timeout fails the test). The in-process broker records the order of
publishes and acknowledgements. Kafka's own paths (poison messages, the DLQ, commits) are in ``test_kafka.py``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import io

import numpy as np
import pytest

import specstream.modalities.image as image_mod
import specstream.stages.attention_maps as amaps
import specstream.pipeline.caption_stages as caption_mod
import specstream.pipeline.live as live_mod
from specstream.errors import ContextLengthError
from specstream.pipeline.broker import TOPIC_FRAMES, TOPIC_LIVE_FRAMES, TOPIC_REQUESTS, TOPIC_RESULTS, InProcessBroker
from specstream.pipeline.messages import CaptionParams, PipelineRequest, Source

pytestmark = pytest.mark.timeout(120)
MAX_NEW = 4


class Injected(RuntimeError):
    """The injected failure."""


def fail_once(obj, name: str, monkeypatch, on_call: int = 1, exc: Exception | None = None,
              when=lambda *a, **k: True):
    """Make ``obj.name`` raise ``exc`` (default :class:`Injected`) on its ``on_call``-th call among those for
    which ``when(*args)`` holds; every other call runs the real one (sync or async alike)."""
    real = getattr(obj, name)
    calls = [0]
    exc = exc or Injected(f"injected at {name}")

    def hit(args, kwargs) -> bool:
        if not when(*args, **kwargs):
            return False
        calls[0] += 1
        return calls[0] == on_call

    if inspect.iscoroutinefunction(real):
        @functools.wraps(real)
        async def wrapper(*args, **kwargs):
            if hit(args, kwargs):
                raise exc
            return await real(*args, **kwargs)
    else:
        @functools.wraps(real)
        def wrapper(*args, **kwargs):
            if hit(args, kwargs):
                raise exc
            return real(*args, **kwargs)
    monkeypatch.setattr(obj, name, wrapper)
    return calls


class RecordingBroker(InProcessBroker):
    """The in-process broker, recording ``("publish", topic, key, value)`` and ``("done", topic, key, index)``
    in order (``index``: position of the message in its topic)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple] = []
        self._taken: dict[str, int] = {}

    async def publish(self, topic, key, value, headers=None):
        await super().publish(topic, key, value, headers)
        self.events.append(("publish", topic, key, value))

    async def subscribe(self, topic):
        async for msg in super().subscribe(topic):
            index = self._taken[topic] = self._taken.get(topic, -1) + 1
            msg.on_done = functools.partial(self.events.append, ("done", topic, msg.key, index))
            yield msg

    def records(self, topic: str) -> list:
        return [e[3] for e in self.events if e[0] == "publish" and e[1] == topic]

    def acks(self, topic: str) -> list[tuple]:
        return [e for e in self.events if e[0] == "done" and e[1] == topic]

    def assert_acked_after_output(self, topic: str, key: str, out_topic: str, of=lambda value, index: True) -> None:
        """``key``'s messages on ``topic`` were acknowledged once each, each after the records on ``out_topic``
        that answer it (``of(record, message index)``; default: every record of ``key``)."""
        acks = [(i, e[3]) for i, e in enumerate(self.events) if e[0] == "done" and e[1] == topic and e[2] == key]
        assert acks, self.events
        indices = [index for _, index in acks]
        assert len(indices) == len(set(indices)), "a message acknowledged twice"
        for at, index in acks:
            answers = [i for i, e in enumerate(self.events) if e[0] == "publish" and e[1] == out_topic
                       and e[2] == key and of(e[3], index)]
            assert answers and max(answers) < at, (index, self.events)


# -- the caption stage ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def captioner():
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.caption import Captioner

    target, draft = default_caption_models(quiet=True)
    return Captioner(target, [str(draft)])


@pytest.fixture(scope="module")
def image():
    from specstream.modalities.image import load_image
    from media import sources

    return load_image(sources()["astronaut"])[::4, ::4]


BY_SEQ = lambda result, index: result.seq == index  # noqa: E731  (frame task n is answered by result n)


class MemoryChainStore:
    def __init__(self):
        self.values = {}

    async def get(self, request_id, seq):
        return self.values.get((request_id, seq))

    async def put(self, request_id, seq, tokens):
        self.values[(request_id, seq)] = list(tokens)


def run_caption_stage(captioner, frames, setup=None, attention_maps=None, chain_store=None):
    """Run a caption stage over ``frames``; returns (results by seq, broker). ``setup(stage, broker)`` injects."""
    from specstream.pipeline.caption_stages import CaptionStage

    async def go():
        broker = RecordingBroker()
        stage = CaptionStage(broker, captioner, attention_maps, chain_store=chain_store)
        if setup is not None:
            setup(stage, broker)
        task = asyncio.create_task(stage.run())
        for f in frames:
            await InProcessBroker.publish(broker, TOPIC_FRAMES, f.request_id, f)
        await broker.close_topic(TOPIC_FRAMES)
        await asyncio.wait_for(task, 90)
        return broker

    broker = asyncio.run(go())
    return {r.seq: r for r in broker.records(TOPIC_RESULTS)}, broker


def two_frames(image, prompt="Describe this image.", start_seq=0):
    from specstream.pipeline.caption_stages import FrameTask

    params = CaptionParams(prompt=prompt, max_new_tokens=MAX_NEW)
    return [FrameTask("r", "clip.mp4", "video", params, frame_index=10 * i, timestamp_s=0.4 * i, image=image,
                      last=i == 1, seq=i) for i in range(start_seq, 2)]


@pytest.fixture(scope="module")
def clean_run(captioner, image):
    results, _ = run_caption_stage(captioner, two_frames(image))
    assert [(r.seq, r.status, r.final) for r in results.values()] == [(0, "ok", False), (1, "ok", True)]
    return results


CAPTION_FAULTS = {
    # name: (installer(stage, broker, monkeypatch, captioner), faulted seq, expected code, message)
    "prepare": (lambda st, b, mp, c: fail_once(c.vlm, "prepare", mp, on_call=2), 1, "corrupt_media",
                "image preprocessing failed: injected at prepare"),
    "make_request": (lambda st, b, mp, c: fail_once(c, "make_request", mp), 0, "internal_error",
                     "Injected: injected at make_request"),
    "loop_submit": (lambda st, b, mp, c: fail_once(st.loop, "submit", mp, on_call=2), 1, "internal_error",
                    "Injected: injected at submit"),
    "publish_result": (lambda st, b, mp, c: fail_once(b, "publish", mp, when=lambda t, k, v, h=None:
                                                      t == TOPIC_RESULTS), 0, "internal_error",
                       "Injected: injected at publish"),
}


@pytest.mark.parametrize("point", sorted(CAPTION_FAULTS))
def test_caption_stage_failure_at_each_await_point_is_the_frames_error(point, captioner, image, clean_run,
                                                                       monkeypatch):
    install, bad_seq, code, message = CAPTION_FAULTS[point]
    results, broker = run_caption_stage(captioner, two_frames(image),
                                        setup=lambda st, b: install(st, b, monkeypatch, captioner))
    assert sorted(results) == [0, 1] and [results[s].final for s in (0, 1)] == [False, True]
    bad = results[bad_seq]
    assert (bad.status, bad.error.code, bad.error.message) == ("error", code, message)
    good = results[1 - bad_seq]
    assert good.status == "ok" and good.output["tokens"] == clean_run[1 - bad_seq].output["tokens"]
    broker.assert_acked_after_output(TOPIC_FRAMES, "r", TOPIC_RESULTS, BY_SEQ)
    assert len(broker.acks(TOPIC_FRAMES)) == 2


def test_prompt_longer_than_the_context_is_the_frames_error(captioner, image, clean_run):
    """``ContextLengthError`` from ``make_request`` (before: it killed the stage task, and the CLI hung)."""
    long_prompt = " ".join(["word"] * 1000)
    with pytest.raises(ContextLengthError):
        captioner.make_request(captioner.vlm.prepare(image, long_prompt), MAX_NEW)
    frames = two_frames(image)
    frames[0].params = CaptionParams(prompt=long_prompt, max_new_tokens=MAX_NEW)
    results, broker = run_caption_stage(captioner, frames)
    assert (results[0].status, results[0].error.code, results[0].final) == ("error", "context_length_exceeded", False)
    assert "does not fit the context" in results[0].error.message
    assert results[1].status == "ok" and results[1].final
    broker.assert_acked_after_output(TOPIC_FRAMES, "r", TOPIC_RESULTS, BY_SEQ)
    assert not captioner.executor.states and not captioner.loop._entries, "a refused request left state behind"


def test_attention_map_and_chain_store_failures(captioner, image, clean_run, monkeypatch, tmp_path):
    """Writing the attention map fails: that frame's error. The chain store (drafting only) fails to give or
    keep the previous caption: the frame is still captioned, identically (greedy output does not depend on the
    draft)."""
    fail_once(amaps, "save_attention_map", monkeypatch)
    results, broker = run_caption_stage(captioner, two_frames(image), attention_maps=tmp_path)
    assert (results[0].status, results[0].error.code) == ("error", "internal_error")
    assert "injected at save_attention_map" in results[0].error.message
    assert results[1].status == "ok" and results[1].output["tokens"] == clean_run[1].output["tokens"]

    store = MemoryChainStore()
    fail_once(store, "put", monkeypatch)
    fail_once(store, "get", monkeypatch)
    results, broker = run_caption_stage(captioner, two_frames(image), chain_store=store)
    assert [r.output["tokens"] for r in results.values()] == [r.output["tokens"] for r in clean_run.values()]
    results, broker = run_caption_stage(captioner, two_frames(image, start_seq=1), chain_store=store)  # get fails
    assert results[1].status == "ok" and results[1].output["tokens"] == clean_run[1].output["tokens"]
    broker.assert_acked_after_output(TOPIC_FRAMES, "r", TOPIC_RESULTS)


def test_error_record_that_cannot_be_published_leaves_the_frame_uncommitted(captioner, image, monkeypatch):
    """Both the result and its error record are refused: the message is not acknowledged (``fail``), so a
    log-based broker redelivers it; the next frame is still answered."""
    failed = []
    calls = [0]

    def setup(stage, broker):
        real = broker.publish

        async def publish(topic, key, value, headers=None):
            if topic == TOPIC_RESULTS and value.seq == 0:
                calls[0] += 1
                raise Injected("broker down")
            await real(topic, key, value, headers)

        monkeypatch.setattr(broker, "publish", publish)

    from specstream.pipeline import broker as broker_mod

    real_fail = broker_mod.Message.fail
    monkeypatch.setattr(broker_mod.Message, "fail", lambda self: (failed.append(self.value.seq), real_fail(self)))
    results, broker = run_caption_stage(captioner, two_frames(image), setup=setup)
    assert calls[0] == 2 and failed == [0]  # the result, then its error record
    assert sorted(results) == [1] and results[1].status == "ok"
    assert [a[3] for a in broker.acks(TOPIC_FRAMES)] == [1]


# -- the keyframe stage ---------------------------------------------------------------------------------------------


def run_keyframe_stage(requests, setup=None):
    from specstream.pipeline.caption_stages import KeyframeStage

    async def go():
        broker = RecordingBroker()
        stage = KeyframeStage(broker)
        if setup is not None:
            setup(stage, broker)
        for req in requests:
            await InProcessBroker.publish(broker, TOPIC_REQUESTS, req.id, req)
        await broker.close_topic(TOPIC_REQUESTS)
        await asyncio.wait_for(stage.run(), 90)
        return broker

    broker = asyncio.run(go())
    by_id: dict[str, list] = {}
    for t in broker.records(TOPIC_FRAMES):
        by_id.setdefault(t.request_id, []).append(t)
    return by_id, broker


def kf_requests(clips, src):
    return [PipelineRequest(id="video", source=Source(uri=str(clips["joined.mp4"]))),
            PipelineRequest(id="image", source=Source(uri=src["astronaut"]))]


def assert_well_formed(tasks: list) -> None:
    assert [t.seq for t in tasks] == list(range(len(tasks)))
    assert [t.last for t in tasks] == [False] * (len(tasks) - 1) + [True]
    assert all(t.error is None for t in tasks[:-1])


KEYFRAME_FAULTS = {
    # name: (installer(broker, monkeypatch), request hit, frame tasks published before the error, message)
    "media_kind": (lambda b, mp: fail_once(caption_mod, "media_kind", mp,
                                           when=lambda path, name=None: str(name).endswith(".png")),
                   "image", 0, "Injected: injected at media_kind"),
    "load_image": (lambda b, mp: fail_once(image_mod, "load_image", mp), "image", 0,
                   "Injected: injected at load_image"),
    "keyframe_step": (lambda b, mp: fail_once(caption_mod, "_next_keyframe", mp, on_call=3), "video", 1,
                      "Injected: injected at _next_keyframe"),
    "publish_frame": (lambda b, mp: fail_once(b, "publish", mp, on_call=2, when=lambda t, k, v, h=None:
                                              k == "video"), "video", 1, "Injected: injected at publish"),
}


@pytest.mark.parametrize("point", sorted(KEYFRAME_FAULTS))
def test_keyframe_stage_failure_at_each_await_point_is_the_requests_error(point, clips, src, monkeypatch):
    install, hit, before, message = KEYFRAME_FAULTS[point]
    by_id, broker = run_keyframe_stage(kf_requests(clips, src), lambda stage, b: install(b, monkeypatch))
    for rid, tasks in by_id.items():
        assert_well_formed(tasks)
        broker.assert_acked_after_output(TOPIC_REQUESTS, rid, TOPIC_FRAMES)
    tasks = by_id[hit]
    assert len(tasks) == before + 1
    assert (tasks[-1].error.code, tasks[-1].error.message) == ("internal_error", message)
    other = by_id["image" if hit == "video" else "video"]
    assert other[-1].error is None and len(other) == (1 if hit == "video" else 3)  # joined.mp4: 3 keyframes


# -- the live keyframe stage ----------------------------------------------------------------------------------------


def jpeg(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


class MemoryStateStore:
    def __init__(self):
        self.values = {}

    def get(self, key):
        return self.values.get(key)

    async def put(self, key, value):
        self.values[key] = value


def run_live_stage(frames, setup=None, dead_letter=None):
    from specstream.pipeline.broker import Message
    from specstream.pipeline.live import LiveKeyframeStage

    async def go():
        broker = RecordingBroker()
        stage = LiveKeyframeStage(broker, MemoryStateStore(), dead_letter=dead_letter)
        if setup is not None:
            setup(stage, broker)
        q = broker._queue(TOPIC_LIVE_FRAMES)
        for i, (key, data, headers) in enumerate(frames):
            await q.put(Message(TOPIC_LIVE_FRAMES, key, data, headers, partition=0, offset=i))
        await broker.close_topic(TOPIC_LIVE_FRAMES)
        await asyncio.wait_for(stage.run(), 60)
        for st in stage.streams.values():  # release the held ring (the stream went quiet)
            while st.ring:
                st.ring.popleft()[2].done()
        return broker

    return asyncio.run(go())


def live_frames(image, n=60):
    """One still shot at 25 fps, 2.4 s: the selector reports its start (frame 0) at frame 45, once no stronger
    boundary can follow within the minimum scene length."""
    data = jpeg(image)
    return [("cam", data, {"stream_id": "cam", "pts": f"{0.04 * i:.2f}"}) for i in range(n)]


LIVE_FAULTS = {
    "decode": lambda st, b, mp: fail_once(live_mod, "decode_image_bytes", mp, on_call=2),
    "publish": lambda st, b, mp: fail_once(b, "publish", mp, when=lambda t, k, v, h=None: t == TOPIC_FRAMES),
    "state_put": lambda st, b, mp: fail_once(st.store, "put", mp, on_call=2),
}


@pytest.mark.parametrize("point", sorted(LIVE_FAULTS))
def test_live_stage_failure_at_each_await_point_is_the_streams_error(point, image, monkeypatch):
    broker = run_live_stage(live_frames(image), setup=lambda st, b: LIVE_FAULTS[point](st, b, monkeypatch))
    out = [(t.seq, "error" if getattr(t, "status", "ok") == "error" else "frame")
           for t in broker.records(TOPIC_FRAMES) + broker.records(TOPIC_RESULTS)]
    assert len(broker.records(TOPIC_FRAMES)) == (0 if point == "publish" else 1)  # the still shot's keyframe
    errors = [r for r in broker.records(TOPIC_RESULTS) if r.status == "error"]
    assert len(errors) == 1 and errors[0].error.code == "internal_error" and not errors[0].final
    assert "injected" in errors[0].error.message
    seqs = sorted(s for s, _ in out)
    assert seqs == list(range(len(seqs)))  # the error took its own seq; nothing renumbered
    assert sorted(a[3] for a in broker.acks(TOPIC_LIVE_FRAMES)) == list(range(60))  # every frame released once


def test_live_frame_without_stream_whose_dead_letter_fails_once_is_retried(image, monkeypatch):
    """A frame without a stream id goes to the DLQ; a failed DLQ publish is retried, then the frame released."""
    sent = []

    class Dlq:
        async def send(self, msg, reason):
            sent.append((msg.offset, reason))

    dlq = Dlq()
    calls = fail_once(dlq, "send", monkeypatch)
    broker = run_live_stage([(None, jpeg(image), {"pts": "0"})], dead_letter=dlq.send)
    assert calls[0] == 2 and len(sent) == 1 and "Injected: injected at send" in sent[0][1]
    assert [a[3] for a in broker.acks(TOPIC_LIVE_FRAMES)] == [0]
