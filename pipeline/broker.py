"""The broker interface between stages: every edge of the stage graph is a topic.

:class:`InProcessBroker` (the embedded default) keeps topics as asyncio queues and passes message objects as
they are; :class:`~specstream.pipeline.kafka.KafkaBroker` carries the same messages serialised. Stage code sees
only :class:`Broker` and :class:`Message`.

Acknowledgement contract (what at-least-once delivery needs from a stage): a stage calls ``message.done()``
once every output of the message has been published (``publish`` returned), whatever the outcome, and exactly
once per message (further calls are ignored). A log-based broker commits a message's offset only after
``done()``. ``message.hold()`` says "processed, but keep it uncommitted" (a live stage that may still need the
frame after later ones); ``done()`` later releases it. ``message.revoked`` turns true when the broker has given
the message's partition to another consumer: the stage may drop the work (still calling ``done()``).
``message.fail()`` says "its outcome could not be published": the message stays uncommitted for good (a log-based
broker redelivers it after a restart or a rebalance) and no longer counts as in flight. A stage whose task is
cancelled (shutdown past the drain timeout) calls none of them: the message stays uncommitted.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

TOPIC_REQUESTS = "specstream.requests"
TOPIC_FRAMES = "specstream.frames.tasks"  # keyframe stage -> caption stage
TOPIC_RESULTS = "specstream.results"
TOPIC_LIVE_FRAMES = "specstream.frames"  # live frame streams (encoded images, headers stream_id and pts)


def _nothing() -> None:
    return None


@dataclass
class Message:
    """A message on a topic: ``key`` (e.g. request or stream id), ``value`` (object or bytes), headers.

    ``partition``/``offset`` are set by a log-based broker (None in process). See the module docstring for
    ``done()``, ``hold()`` and ``revoked``.
    """

    topic: str
    key: str | None
    value: Any
    headers: dict[str, str] = field(default_factory=dict)
    partition: int | None = None
    offset: int | None = None
    on_done: Callable[[], None] = field(default=_nothing, repr=False, compare=False)
    on_hold: Callable[[], None] = field(default=_nothing, repr=False, compare=False)
    is_revoked: Callable[[], bool] = field(default=lambda: False, repr=False, compare=False)
    _state: str = field(default="new", repr=False, compare=False)  # new -> held -> done; new|held -> failed

    def done(self) -> None:
        """Every output of this message is published: the broker may commit it. Idempotent; ignored after
        ``fail()``."""
        if self._state not in ("done", "failed"):
            self._state = "done"
            self.on_done()

    def fail(self) -> None:
        """The message's outcome (not even an error record) could not be published: never commit it (a restart
        or rebalance redelivers it); it stops counting as in flight. Ignored after ``done()``."""
        if self._state == "new":
            self.on_hold()
        if self._state != "done":
            self._state = "failed"

    def hold(self) -> None:
        """Processed, but keep it uncommitted until ``done()`` (it no longer counts as in flight)."""
        if self._state == "new":
            self._state = "held"
            self.on_hold()

    @property
    def revoked(self) -> bool:
        """True once the message's partition was reassigned to another consumer (drop the work)."""
        return self.is_revoked()


class Broker(abc.ABC):
    @abc.abstractmethod
    async def publish(self, topic: str, key: str | None, value: Any, headers: dict[str, str] | None = None) -> None:
        """Append a message to ``topic``; returns once the broker has it."""

    @abc.abstractmethod
    def subscribe(self, topic: str) -> AsyncIterator[Message]:
        """Messages of ``topic`` in order, until the broker closes."""

    async def close(self) -> None:
        """Stop every subscription after the messages already published."""


_CLOSED = object()


class InProcessBroker(Broker):
    """Topics as unbounded asyncio queues, one consumer per topic (a stage), in one event loop.

    Args:
        maxsize: queue bound per topic (0 = unbounded); a full queue makes ``publish`` wait (backpressure).
        topic_maxsize: per-topic bounds that override ``maxsize`` (e.g. bound the full-resolution frames topic,
            leave the small requests topic unbounded).
    """

    def __init__(self, maxsize: int = 0, topic_maxsize: dict[str, int] | None = None):
        self._maxsize = maxsize
        self._topic_maxsize = dict(topic_maxsize or {})
        self._queues: dict[str, asyncio.Queue] = {}
        self.published: dict[str, int] = {}

    def _queue(self, topic: str) -> asyncio.Queue:
        if topic not in self._queues:
            self._queues[topic] = asyncio.Queue(self._topic_maxsize.get(topic, self._maxsize))
        return self._queues[topic]

    async def publish(self, topic, key, value, headers=None):
        await self._queue(topic).put(Message(topic, key, value, dict(headers or {})))
        self.published[topic] = self.published.get(topic, 0) + 1

    async def subscribe(self, topic):
        q = self._queue(topic)
        while True:
            msg = await q.get()
            if msg is _CLOSED:
                return
            yield msg

    async def close_topic(self, topic: str) -> None:
        """End the subscription of ``topic`` once its queued messages are consumed."""
        await self._queue(topic).put(_CLOSED)

    async def close(self):
        for topic in list(self._queues):
            await self.close_topic(topic)


async def consume(broker: "Broker", topic: str, sem: asyncio.Semaphore, handle) -> None:
    """Run ``await handle(msg)`` for every message of ``topic``, at most as many at once as ``sem`` allows, and
    wait for them when the subscription ends. If this task is cancelled (shutdown past the drain timeout), the
    handlers still running are cancelled too: their messages stay uncommitted and are redelivered."""
    tasks: set[asyncio.Task] = set()
    try:
        async for msg in broker.subscribe(topic):
            await sem.acquire()
            task = asyncio.create_task(handle(msg))
            tasks.add(task)
            task.add_done_callback(lambda t: (tasks.discard(t), sem.release()))
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
