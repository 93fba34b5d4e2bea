"""Two stages behind one requests topic: :class:`TaskRouter` splits ``specstream.requests`` by task.

A broker has one subscriber per topic (one consumer group member per stage in Kafka). The worker's requests topic
carries caption requests (for :class:`~specstream.pipeline.caption_stages.KeyframeStage`) and ``video_qa`` /
``transcribe`` / ``generate`` requests (for :class:`~specstream.pipeline.qa_stage.QaStage`); the router consumes it once
and hands each message on, unchanged, to the view of the stage that serves its task. Messages keep their
acknowledgement callbacks, so offsets, commits, redelivery and the DLQ work exactly as with one stage. Each view
holds at most ``maxsize`` messages not yet taken by its stage (beyond that the router waits: backpressure to the
consumer's in-flight limit).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from specstream.pipeline.broker import TOPIC_REQUESTS, Broker

_END = object()


class TaskRouter:
    """Splits the requests topic of ``broker`` between views by ``message.value.task``.

    Args:
        broker: the graph's broker (its requests topic is consumed by :meth:`run`, once).
        default: the view that gets tasks no other view claims (it answers them, e.g. ``unsupported_task``).
    """

    def __init__(self, broker: Broker, default: str = "caption", maxsize: int = 4):
        self.broker = broker
        self.default = default
        self.maxsize = maxsize
        self.views: dict[str, _View] = {}
        self._routes: dict[str, str] = {}

    def view(self, name: str, tasks: Iterable[str] = ()) -> "_View":
        """A broker for one stage: its requests topic yields the messages of ``tasks`` (the default view: every
        task no view claims); every other call goes to the real broker."""
        v = _View(self.broker, asyncio.Queue(self.maxsize))
        self.views[name] = v
        for t in tasks:
            self._routes[t] = name
        return v

    async def run(self) -> None:
        """Route until the requests topic ends, then end every view's subscription (a cancelled router ends
        nothing: its stages are cancelled with it)."""
        async for msg in self.broker.subscribe(TOPIC_REQUESTS):
            task = getattr(msg.value, "task", None)
            await self.views[self._routes.get(task, self.default)].queue.put(msg)
        for v in self.views.values():
            await v.queue.put(_END)


class _View(Broker):
    def __init__(self, broker: Broker, queue: asyncio.Queue):
        self._broker = broker
        self.queue = queue

    async def publish(self, topic, key, value, headers=None) -> None:
        await self._broker.publish(topic, key, value, headers)

    async def subscribe(self, topic):
        if topic != TOPIC_REQUESTS:
            async for msg in self._broker.subscribe(topic):
                yield msg
            return
        while True:
            msg = await self.queue.get()
            if msg is _END:
                return
            yield msg

    def __getattr__(self, name: str) -> Any:  # dead_letter, group_of, ... of the real broker
        return getattr(self._broker, name)
