"""The device-owning task: one :class:`SpeculativeEngine` driven from asyncio.

Async stages submit requests and await futures; the driver adds them to the engine only between steps and
runs each step (schedule -> execute -> update) in a worker thread, so the event loop stays responsive and one
task owns the device.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from specstream.schedulers.plan import Request
from specstream.stages.speculative.engine import SpeculativeEngine


class EngineDriver:
    """Drive ``engine`` from an event loop.

    Args:
        engine: the engine (its scheduler decides; its executor owns the device).
    """

    def __init__(self, engine: SpeculativeEngine):
        self.engine = engine
        self._pending: list[tuple[Request, asyncio.Future, Callable | None, dict]] = []
        self._futures: dict[str, asyncio.Future] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.steps = 0

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-driver")

    async def stop(self) -> None:
        """Finish the requests already submitted, then stop."""
        self._stopping = True
        if self._wake:
            self._wake.set()
        if self._task:
            await self._task

    def abandon(self) -> list[str]:
        """Stop now, without finishing the submitted requests (a shutdown past its drain timeout): the driver task
        is cancelled (a step already running in its thread completes there) and every request's future is
        cancelled. Requests already added stay in the engine. Returns the ids of the requests never added."""
        self._stopping = True
        if self._task:
            self._task.cancel()
        never_added = []
        for req, fut, _, _ in self._pending:
            fut.cancel()
            never_added.append(req.request_id)
        self._pending = []
        for fut in self._futures.values():
            fut.cancel()
        self._futures.clear()
        return never_added

    def submit(self, request: Request, on_tokens: Callable | None = None, **add_kwargs: Any) -> asyncio.Future:
        """Queue ``request``; the future resolves to the finished :class:`Request` (check ``.error``)."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((request, fut, on_tokens, add_kwargs))
        self._wake.set()
        return fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            pending, self._pending = self._pending, []
            for req, fut, cb, kw in pending:
                try:
                    if cb is not None:
                        kw = {**kw, "on_tokens": lambda r, t, cb=cb: loop.call_soon_threadsafe(cb, r, t)}
                    self.engine.add_request(req, **kw)
                    self._futures[req.request_id] = fut
                except Exception as exc:  # a refused request (capacity, invalid) fails alone
                    fut.set_exception(exc)
            if self.engine.has_work():
                finished = await asyncio.to_thread(self.engine.step)
                self.steps += 1
                for req in finished:
                    self.engine.scheduler.pop_finished(req.request_id)
                    fut = self._futures.pop(req.request_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(req)
                continue
            if self._stopping and not self._pending:
                return
            self._wake.clear()
            if not self._pending:
                await self._wake.wait()
