"""The Kafka :class:`~specstream.pipeline.broker.Broker` (aiokafka): at-least-once stage edges.

Delivery rules (see ``docs/kafka.md``):

- Auto-commit is off. A consumed message counts as *in flight* until its stage calls ``Message.done()``, which
  stages do only after every output of the message was acknowledged by the broker (``publish`` waits for
  ``acks=all``). Per partition, :class:`OffsetTracker` advances the commit position to the end of the
  contiguous run of finished offsets (it commits ``offset + 1``); a slow message holds back the commit of the
  later finished ones, never the other way round.
- The poll loop only polls: stages run in their own tasks (slow work in threads or child processes), so
  ``getmany`` is called every ``poll_timeout_ms`` and ``max.poll.interval.ms`` is never exceeded.
- Backpressure: when a consumer has ``max_in_flight`` messages in flight, its partitions are paused (the poll
  loop keeps polling, which keeps the group membership alive) and resumed below the limit.
- Rebalance: on revoke, the done work of the revoked partitions is committed, their trackers are dropped and
  their in-flight messages turn ``revoked`` (stages drop them; a late ``done()`` is ignored). Outputs are
  idempotent by key, so the new owner repeating them is harmless.
- Graceful shutdown (:meth:`KafkaBroker.drain`): pause everything, end the subscriptions, wait for the
  in-flight messages at most ``drain_timeout_s``, commit what finished, leave the group. Work still in flight
  then is cancelled uncommitted, and redelivered to the group's next owner.
- Poison messages (the codec refuses them) go to the DLQ; the offset is committed only once the broker
  acknowledged the DLQ copy. A copy that would exceed ``max_message_bytes`` keeps the head of the payload, with
  the SHA-256 and length of the whole payload in headers.
- Our producer refuses a message over ``max_message_bytes`` itself, with :class:`MessageTooLargeError` (the
  size is counted the way aiokafka's producer counts it).

Each stage is its own consumer group (``{group}.keyframes``, ``{group}.caption``), so the two scale apart.
:class:`StateStore` keeps small per-key state (live stream detector state, previous captions) in a compacted
topic, loaded when partitions are assigned.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from specstream.errors import MessageTooLargeError
from specstream.pipeline.broker import Broker, Message

log = logging.getLogger("specstream.kafka")

_CLOSED = object()


class KafkaSettings(BaseSettings):
    """Worker configuration: flags override environment variables ``SPECSTREAM_KAFKA_<FIELD>`` (upper case)."""

    model_config = SettingsConfigDict(env_prefix="SPECSTREAM_KAFKA_", extra="forbid")

    bootstrap: str = Field("127.0.0.1:9092", description="host:port[,host:port...] of the Kafka brokers")
    group: str = Field("specstream", description="consumer group prefix: {group}.keyframes, {group}.caption")
    stages: Literal["keyframes", "caption", "all"] = "all"
    client_id: str = "specstream-worker"
    # topics
    topic_requests: str = "specstream.requests"
    topic_frames: str = Field("specstream.frames", description="live frame streams (encoded images)")
    topic_frame_tasks: str = Field("specstream.frames.tasks", description="keyframe stage -> caption stage")
    topic_results: str = "specstream.results"
    topic_dlq: str = "specstream.dlq"
    topic_state: str = Field("specstream.state", description="compacted: live stream state, previous captions")
    create_topics: bool = True
    partitions: int = Field(6, ge=1, description="partitions of topics the worker creates")
    replication_factor: int = Field(1, ge=1)
    state_retention_ms: int = Field(7 * 24 * 3600 * 1000, description="retention of the state topic")
    # consumer behaviour
    max_in_flight: int = Field(8, ge=1, description="messages in flight per stage before its partitions pause")
    max_poll_interval_ms: int = 300_000
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    poll_timeout_ms: int = 200
    commit_interval_s: float = 0.5
    drain_timeout_s: float = 120.0
    max_message_bytes: int = Field(8 * 1024 * 1024, description="producer request / topic message limit, bytes")
    # media and safety
    allowed_roots: list[Path] = Field(default_factory=list, description="file:// sources must lie under these")
    max_source_bytes: int = Field(256 * 1024 * 1024, description="size limit of a request's media source")
    frame_format: Literal["png", "jpeg"] = Field("png", description="keyframes on the frame-task topic; png is "
                                                                    "lossless (same captions as embedded)")
    jpeg_quality: int = Field(90, ge=1, le=100)
    # security (passed to aiokafka)
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # models (the caption stage)
    target: str | None = Field(None, description="VLM checkpoint (default: the built-in tiny model)")
    draft: list[str] = Field(default_factory=list)
    # models of the QA stage (video_qa, transcribe, generate), loaded on first use
    text_model: str | None = Field(None, description="text model (video_qa answer_with=text, generate model=text)")
    text_draft: list[str] = Field(default_factory=list)
    speech_model: str | None = Field(None, description="Whisper checkpoint (default: tiny.en)")
    clip_model: str | None = Field(None, description="open_clip architecture or model-config JSON")
    clip_pretrained: str | None = Field(None, description="local weights file of clip_model")
    num_slots: int = 8
    device: str = "cpu"
    dtype: str = Field("float32", description="weight precision: float32, bfloat16, int8, int4, int4-g64, auto")
    draft_dtype: str | None = Field(None, description="weight precision of the drafts (default: dtype)")

    @field_validator("dtype", "draft_dtype")
    @classmethod
    def _weight_precision(cls, v: str | None) -> str | None:
        from specstream.kernels.quant import parse_weight_format

        if v is None or v == "auto":
            return v
        return parse_weight_format(v).label  # ValueError names the precisions

    @field_validator("bootstrap")
    @classmethod
    def _strip_scheme(cls, v: str) -> str:
        return v[len("kafka://"):] if v.startswith("kafka://") else v

    def client_kwargs(self) -> dict[str, Any]:
        """Connection and security keywords shared by aiokafka's producer, consumers and admin client."""
        kw: dict[str, Any] = {"bootstrap_servers": self.bootstrap, "client_id": self.client_id,
                              "security_protocol": self.security_protocol}
        if self.sasl_mechanism:
            kw.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_plain_username,
                      sasl_plain_password=self.sasl_plain_password)
        if self.security_protocol in ("SSL", "SASL_SSL"):
            from aiokafka.helpers import create_ssl_context

            kw["ssl_context"] = create_ssl_context(cafile=self.ssl_cafile, certfile=self.ssl_certfile,
                                                   keyfile=self.ssl_keyfile)
        return kw


class OffsetTracker:
    """Offsets of one partition: received in order, finished in any order; ``committable`` is ``offset + 1`` of
    the last message of the contiguous finished run (None before any)."""

    def __init__(self) -> None:
        self._received: deque[int] = deque()
        self._finished: set[int] = set()
        self.committable: int | None = None
        self.committed: int | None = None
        self.revoked = False

    def add(self, offset: int) -> None:
        if self._received and offset <= self._received[-1]:
            raise ValueError(f"offset {offset} not after {self._received[-1]}")
        self._received.append(offset)

    def finish(self, offset: int) -> None:
        self._finished.add(offset)
        while self._received and self._received[0] in self._finished:
            first = self._received.popleft()
            self._finished.discard(first)
            self.committable = first + 1

    @property
    def pending(self) -> int:
        return len(self._received)


@dataclass
class Codec:
    """How a topic's values travel: ``encode(value) -> (bytes, headers)``, ``decode(bytes, headers) -> value``
    (raises on a bad message; the broker hands it to ``on_bad``)."""

    encode: Callable[[Any], tuple[bytes | None, dict[str, str]]]
    decode: Callable[[bytes | None, dict[str, str]], Any]


BYTES = Codec(lambda v: (v, {}), lambda b, h: b)

#: called with (the raw message, the decode error); publishes an error result or a DLQ record
BadMessageHandler = Callable[[Message, Exception], Awaitable[None]]
#: called with the partitions of one consumer group: (topic, partition) pairs
RebalanceHook = Callable[[list[tuple[str, int]]], Awaitable[None]]


class _GroupConsumer:
    """One consumer group member: the poll loop, offset trackers, commits, pause/resume, rebalance handling."""

    def __init__(self, broker: KafkaBroker, group_id: str, topics: list[str]):
        self.broker = broker
        self.group_id = group_id
        self.topics = topics
        self.s = broker.settings
        self.trackers: dict[Any, OffsetTracker] = {}
        self.in_flight = 0
        self.consumer = None
        self.assigned = asyncio.Event()
        self.generations = 0  # number of assignments seen
        self.on_assigned: list[RebalanceHook] = []
        self.on_revoked: list[RebalanceHook] = []
        self._paused = False
        self._draining = False
        self._stop = False
        self._task: asyncio.Task | None = None
        self._last_commit = 0.0
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener

        outer = self

        class Listener(ConsumerRebalanceListener):
            async def on_partitions_revoked(self, revoked):
                await outer._revoked(list(revoked))

            async def on_partitions_assigned(self, assigned):
                await outer._assigned(list(assigned))

        self.consumer = AIOKafkaConsumer(
            **self.s.client_kwargs(), group_id=self.group_id, enable_auto_commit=False,
            auto_offset_reset="earliest", max_poll_interval_ms=self.s.max_poll_interval_ms,
            session_timeout_ms=self.s.session_timeout_ms, heartbeat_interval_ms=self.s.heartbeat_interval_ms,
            max_partition_fetch_bytes=self.s.max_message_bytes, fetch_max_bytes=self.s.max_message_bytes * 2)
        await self.consumer.start()
        self.consumer.subscribe(self.topics, listener=Listener())
        self._task = asyncio.create_task(self._poll_loop(), name=f"poll-{self.group_id}")

    # -- rebalance --------------------------------------------------------------------------------------------
    async def _revoked(self, tps) -> None:
        log.info("%s: revoked %s", self.group_id, sorted((tp.topic, tp.partition) for tp in tps))
        await self.commit(force=True, only=tps)
        for tp in tps:
            tr = self.trackers.pop(tp, None)
            if tr is not None:
                tr.revoked = True
        for hook in self.on_revoked:
            await hook([(tp.topic, tp.partition) for tp in tps])
        self.assigned.clear()

    async def _assigned(self, tps) -> None:
        log.info("%s: assigned %s", self.group_id, sorted((tp.topic, tp.partition) for tp in tps))
        for tp in tps:
            self.trackers[tp] = OffsetTracker()
        for hook in self.on_assigned:
            await hook([(tp.topic, tp.partition) for tp in tps])
        self.generations += 1
        if tps:
            self.assigned.set()
        if self._draining or self._paused:
            self.consumer.pause(*tps)

    # -- the poll loop ----------------------------------------------------------------------------------------
    def _apply_backpressure(self) -> None:
        want = self._draining or self.in_flight >= self.s.max_in_flight
        assignment = list(self.consumer.assignment())
        if want and assignment:
            self.consumer.pause(*assignment)
        elif not want and self._paused and assignment:
            self.consumer.resume(*assignment)
        self._paused = want

    async def _poll_loop(self) -> None:
        from aiokafka.errors import KafkaError

        while not self._stop:
            self._apply_backpressure()
            try:
                batch = await self.consumer.getmany(timeout_ms=self.s.poll_timeout_ms,
                                                    max_records=self.s.max_in_flight)
            except KafkaError as exc:
                log.warning("%s: poll failed: %s", self.group_id, exc)
                await asyncio.sleep(0.5)
                continue
            for tp, records in batch.items():
                tracker = self.trackers.get(tp)
                if tracker is None or self._draining:
                    continue
                for rec in records:
                    tracker.add(rec.offset)
                    self._dispatch(tp, tracker, rec)
            if time.monotonic() - self._last_commit >= self.s.commit_interval_s:
                await self.commit()

    def _dispatch(self, tp, tracker: OffsetTracker, rec) -> None:
        self.in_flight += 1
        self._idle.clear()
        counted = [True]

        def release() -> None:
            if counted[0]:
                counted[0] = False
                self.in_flight -= 1
                if self.in_flight == 0:
                    self._idle.set()

        def on_done() -> None:
            release()
            if not tracker.revoked:
                tracker.finish(rec.offset)

        headers = {k: (v.decode("utf-8", "replace") if v is not None else "") for k, v in (rec.headers or ())}
        key = rec.key.decode("utf-8", "replace") if rec.key is not None else None
        topic = self.broker.graph_name(tp.topic)
        msg = Message(topic, key, rec.value, headers, partition=tp.partition, offset=rec.offset,
                      on_done=on_done, on_hold=release, is_revoked=lambda: tracker.revoked)
        codec = self.broker.codecs.get(topic, BYTES)
        try:
            msg.value = codec.decode(rec.value, headers)
        except Exception as exc:  # a poison message: an error result or the DLQ, then it is done
            msg.value = rec.value
            self.broker._spawn(self._bad(msg, exc))
            return
        self.broker._queue(topic).put_nowait(msg)

    async def _bad(self, msg: Message, exc: Exception) -> None:
        """A message its codec refused: the topic's handler (an error result) or the DLQ; committed only once
        that output was acknowledged, else left uncommitted (redelivered after a restart or rebalance)."""
        try:
            handler = self.broker.on_bad.get(msg.topic)
            if handler is None:
                await self.broker.dead_letter(msg, f"undecodable: {exc}")
            else:
                await handler(msg, exc)
        except Exception:
            log.exception("%s: bad message %s/%s could not be answered or dead-lettered (left uncommitted)",
                          self.group_id, msg.partition, msg.offset)
            msg.fail()
            return
        msg.done()

    # -- commits ----------------------------------------------------------------------------------------------
    async def commit(self, force: bool = False, only=None) -> None:
        """Commit every partition whose contiguous finished run moved (``only``: these partitions)."""
        from aiokafka import TopicPartition  # noqa: F401  (the keys are aiokafka TopicPartitions)
        from aiokafka.errors import KafkaError

        self._last_commit = time.monotonic()
        offsets = {}
        for tp, tr in self.trackers.items():
            if only is not None and tp not in only:
                continue
            if tr.committable is not None and tr.committable != tr.committed:
                offsets[tp] = tr.committable
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except KafkaError as exc:  # a rebalance in progress: the new owner redoes the work (idempotent)
            log.warning("%s: commit of %s failed: %s", self.group_id, offsets, exc)
            return
        for tp, off in offsets.items():
            tr = self.trackers.get(tp)
            if tr is not None:
                tr.committed = off

    # -- shutdown ---------------------------------------------------------------------------------------------
    def stop_dispatching(self) -> None:
        """From now on records the poll loop still receives are neither tracked nor handed to a stage: they stay
        uncommitted (redelivered to the next owner), and the drain does not wait for them."""
        self._draining = True

    async def drain(self, timeout_s: float) -> bool:
        """Pause every partition, wait until nothing is in flight (``timeout_s``), commit. True when drained."""
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            drained = True
        except asyncio.TimeoutError:
            n = self.in_flight
            log.warning("%s: %d message%s still in flight after %g s: left uncommitted, to be redelivered",
                        self.group_id, n, "" if n == 1 else "s", timeout_s)
            drained = False
        await self.commit(force=True)
        return drained

    async def stop(self) -> None:
        self._stop = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.consumer is not None:
            await self.commit(force=True)
            await self.consumer.stop()


class KafkaBroker(Broker):
    """Topics on Kafka (aiokafka). Publishing waits for the broker's acknowledgement (``acks=all``).

    Args:
        settings: connection, topics, limits (:class:`KafkaSettings`).
        groups: consumer group id -> the topics that group's member consumes (one aiokafka consumer each).
        codecs: topic -> :class:`Codec` (default: raw bytes).
        on_bad: topic -> handler of messages its codec rejects (default: the DLQ).
        topic_names: the stage graph's topic names (``pipeline.broker.TOPIC_*``) -> the names on Kafka, when
            configured differently. Stages, codecs and ``on_bad`` use the graph's names; ``groups`` Kafka's.
    """

    def __init__(self, settings: KafkaSettings, groups: dict[str, list[str]] | None = None,
                 codecs: dict[str, Codec] | None = None, on_bad: dict[str, BadMessageHandler] | None = None,
                 topic_names: dict[str, str] | None = None):
        self.settings = settings
        self.topic_names = dict(topic_names or {})
        self._graph_names = {v: k for k, v in self.topic_names.items()}
        self.codecs = dict(codecs or {})
        self.on_bad = dict(on_bad or {})
        self.groups = {g: _GroupConsumer(self, g, list(t)) for g, t in (groups or {}).items()}
        self.producer = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: set[asyncio.Task] = set()
        self.published: dict[str, int] = {}

    # -- lifecycle --------------------------------------------------------------------------------------------
    async def connect(self, topics: list[tuple[str, dict[str, str]]] = ()) -> None:
        """Create ``topics`` ((name, configs) pairs) when ``create_topics`` and start the producer: the first
        contact with the brokers, so an unreachable bootstrap fails here, before any model loads.

        Raises:
            aiokafka.errors.KafkaConnectionError: no broker of ``bootstrap`` answers.
        """
        from aiokafka import AIOKafkaProducer

        if self.producer is not None:
            return
        if self.settings.create_topics and topics:
            await create_topics(self.settings, topics)
        producer = AIOKafkaProducer(**self.settings.client_kwargs(), acks="all", linger_ms=2,
                                    max_request_size=self.settings.max_message_bytes)
        try:
            await producer.start()
        except BaseException:
            await producer.stop()
            raise
        self.producer = producer

    async def start(self, topics: list[tuple[str, dict[str, str]]] = ()) -> None:
        """:meth:`connect` (when not done yet), then start the consumers (join the groups)."""
        await self.connect(topics)
        for g in self.groups.values():
            await g.start()

    async def wait_assigned(self, timeout_s: float = 60.0) -> None:
        """Until every consumer group member has partitions (tests wait for this instead of sleeping)."""
        await asyncio.wait_for(asyncio.gather(*(g.assigned.wait() for g in self.groups.values())), timeout_s)

    async def drain(self) -> bool:
        """Graceful shutdown, part 1: stop fetching, end subscriptions, wait for in-flight work (at most
        ``drain_timeout_s``), commit what finished. True when nothing was left in flight."""
        for g in self.groups.values():
            g.stop_dispatching()
        for topic in list(self._queues):
            self._queue(topic).put_nowait(_CLOSED)
        results = await asyncio.gather(*(g.drain(self.settings.drain_timeout_s) for g in self.groups.values()))
        return all(results)

    async def close(self) -> None:
        """Graceful shutdown, part 2 (after the stages returned): commit, leave the groups, stop the producer."""
        for g in self.groups.values():
            await g.stop()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.producer is not None:
            await self.producer.stop()
            self.producer = None

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _queue(self, topic: str) -> asyncio.Queue:
        if topic not in self._queues:
            self._queues[topic] = asyncio.Queue()
        return self._queues[topic]

    def kafka_name(self, topic: str) -> str:
        return self.topic_names.get(topic, topic)

    def graph_name(self, topic: str) -> str:
        return self._graph_names.get(topic, topic)

    def group_of(self, topic: str) -> _GroupConsumer:
        for g in self.groups.values():
            if self.kafka_name(topic) in g.topics:
                return g
        raise KeyError(f"no consumer group consumes {topic!r}")

    # -- Broker -----------------------------------------------------------------------------------------------
    async def publish(self, topic, key, value, headers=None):
        codec = self.codecs.get(topic, BYTES)
        data, extra = codec.encode(value)
        hdrs = {**extra, **(headers or {})}
        await self.publish_raw(topic, key, data, hdrs)

    async def publish_raw(self, topic: str, key: str | None, data: bytes | None,
                          headers: dict[str, str] | None = None) -> None:
        """Send bytes as they are; returns after the broker acknowledged them.

        Raises:
            MessageTooLargeError: the record is over ``max_message_bytes`` (nothing is sent).
            aiokafka.errors.KafkaError: the broker did not acknowledge it.
        """
        kkey = key.encode() if key is not None else None
        hdrs = [(k, str(v).encode()) for k, v in (headers or {}).items()]
        size = record_size(kkey, data, hdrs)
        limit = self.settings.max_message_bytes
        if size > limit:
            raise MessageTooLargeError(
                f"a message of {size} bytes for topic {self.kafka_name(topic)!r} is over the limit of {limit} bytes "
                f"(max_message_bytes, SPECSTREAM_KAFKA_MAX_MESSAGE_BYTES); it was not sent")
        await self.producer.send_and_wait(self.kafka_name(topic), data, key=kkey, headers=hdrs)
        self.published[topic] = self.published.get(topic, 0) + 1

    async def subscribe(self, topic):
        self.group_of(topic)  # fail early for a topic nobody consumes
        q = self._queue(topic)
        while True:
            msg = await q.get()
            if msg is _CLOSED:
                return
            yield msg

    async def dead_letter(self, msg: Message, reason: str) -> None:
        """The message's original bytes to the DLQ, with the reason and where it came from in headers; returns
        once the broker acknowledged the copy (raises otherwise).

        Headers: ``dlq.reason``, ``dlq.topic``, ``dlq.partition``, ``dlq.offset``, ``dlq.sha256`` and
        ``dlq.original_bytes`` (of the whole original value), and ``dlq.truncated: true`` when the copy keeps only
        the head of the value so that the record fits ``max_message_bytes``. The original message's own headers
        are kept when they fit in half the limit (else dropped; ``dlq.headers_dropped`` counts them).
        """
        raw = msg.value if isinstance(msg.value, (bytes, type(None))) else str(msg.value).encode()
        body = raw or b""
        limit = self.settings.max_message_bytes
        own = {k: v for k, v in msg.headers.items() if not k.startswith("dlq.")}
        headers = dict(own)
        if record_size(None, b"", [(k, str(v).encode()) for k, v in own.items()]) > limit // 2:
            headers = {"dlq.headers_dropped": str(len(own))}
        headers.update({"dlq.reason": reason[:1000], "dlq.topic": self.kafka_name(msg.topic),
                        "dlq.partition": str(msg.partition), "dlq.offset": str(msg.offset),
                        "dlq.sha256": hashlib.sha256(body).hexdigest(), "dlq.original_bytes": str(len(body))})
        key = msg.key.encode() if msg.key is not None else None
        if raw is not None:
            hdrs = [(k, str(v).encode()) for k, v in {**headers, "dlq.truncated": "true"}.items()]
            room = limit - record_size(key, b"", hdrs) - 8  # 8: the value length's varint grows with the value
            if len(raw) > room:
                raw = raw[:max(0, room)]
                headers["dlq.truncated"] = "true"
        await self.publish_raw(self.settings.topic_dlq, msg.key, raw, headers)


def record_size(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]) -> int:
    """Upper bound of one record's size in a v2 record batch, bytes: the estimate aiokafka's producer compares
    with ``max_request_size`` (batch header + record overhead + key, value and headers)."""
    from aiokafka.record.default_records import DefaultRecordBatchBuilder

    return DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers)


async def create_topics(settings: KafkaSettings, topics: list[tuple[str, dict[str, str]]]) -> None:
    """Create the topics that do not exist (an existing topic is left as it is)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(**settings.client_kwargs())
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        new = [NewTopic(name, settings.partitions, settings.replication_factor, topic_configs=dict(cfg))
               for name, cfg in topics if name not in existing]
        if new:
            resp = await admin.create_topics(new)
            for name, code, *rest in getattr(resp, "topic_errors", ()):
                if code not in (0, 36):  # 36: TOPIC_ALREADY_EXISTS (another worker won the race)
                    raise RuntimeError(f"cannot create topic {name}: error {code} {rest}")
    finally:
        await admin.close()


class StateStore:
    """Small per-key JSON state in a compacted topic, mirrored in memory.

    ``load()`` reads the topic from the beginning to its end offsets (called when partitions are assigned, so
    a worker sees what the previous owner wrote); ``put`` publishes and waits for the acknowledgement.
    """

    def __init__(self, broker: KafkaBroker, topic: str):
        self.broker = broker
        self.topic = topic
        self.values: dict[str, Any] = {}
        self._lock = asyncio.Lock()

    async def load(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        async with self._lock:
            consumer = AIOKafkaConsumer(**self.broker.settings.client_kwargs(), enable_auto_commit=False,
                                        group_id=None, auto_offset_reset="earliest")
            await consumer.start()
            try:
                parts = consumer.partitions_for_topic(self.topic)
                if not parts:
                    await consumer.topics()
                    parts = consumer.partitions_for_topic(self.topic) or set()
                tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
                if not tps:
                    return
                consumer.assign(tps)
                await consumer.seek_to_beginning(*tps)
                end = await consumer.end_offsets(tps)
                values: dict[str, Any] = {}
                while [tp for tp in tps if await consumer.position(tp) < end[tp]]:
                    batch = await consumer.getmany(timeout_ms=500)
                    for records in batch.values():
                        for rec in records:
                            key = rec.key.decode()
                            if rec.value is None:
                                values.pop(key, None)
                            else:
                                values[key] = json.loads(rec.value)
                self.values.update(values)
            finally:
                await consumer.stop()

    def get(self, key: str) -> Any:
        return self.values.get(key)

    async def put(self, key: str, value: Any) -> None:
        self.values[key] = value
        data = None if value is None else json.dumps(value, separators=(",", ":")).encode()
        await self.broker.publish_raw(self.topic, key, data)


class CaptionChainStore:
    """The caption stage's ``chain_store`` on a :class:`StateStore`: the last few captions of each video."""

    KEEP = 4

    def __init__(self, store: StateStore):
        self.store = store

    async def get(self, request_id: str, seq: int) -> list[int] | None:
        entry = self.store.get(f"chain/{request_id}") or {}
        return entry.get(str(seq))

    async def put(self, request_id: str, seq: int, tokens: list[int]) -> None:
        entry = dict(self.store.get(f"chain/{request_id}") or {})
        entry[str(seq)] = list(tokens)
        for k in sorted(entry, key=int)[: -self.KEEP]:
            del entry[k]
        await self.store.put(f"chain/{request_id}", entry)
