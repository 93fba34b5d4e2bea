"""One device loop per device: every model of the process, stepped by one scheduler.

A :class:`DeviceLoop` owns the model runners of one device — a VLM decoder (which also serves text-only requests),
a Whisper decoder, a plain LM, their drafts, and the vision and audio encoders — and one scheduler
(:class:`~specstream.schedulers.qos.QosScheduler` for several models). Each step:

1. ``scheduler.schedule() -> StepPlan``: encode batches per modality, prefill chunks and tree budgets of every
   request of every model, preemptions — one plan, so the QoS classes hold across models;
2. the encode batches run on the runner that consumes their modality, then each model with rows in the plan runs
   **one** forward for all of them (text-only and image requests to the same VLM share it), models holding
   realtime rows first;
3. ``scheduler.update(output)`` books everything.

A request names its model (``Request.model``) and carries its multimodal inputs (``Request.mm_inputs``); the
runner's encoder stores each encoder output in the request's executor record and the runner's one prefill hook
turns them into prefill inputs (prompt embeddings for a VLM, cross-attention keys/values for Whisper); everything
is dropped with the record. Stages never touch executor internals: they build requests with
:meth:`ModelRunner.make_request` and submit them.

Threading: :meth:`DeviceLoop.start` runs the steps in one dedicated thread (``specstream-device-<device>``);
stages in any asyncio event loop ``await loop.submit(request)``. Without ``start`` the loop steps in the caller's
thread (:meth:`step`, :meth:`run`: tests, the CLI). :func:`device_loop` returns the process's one loop for a
device (vLLM's engine core shape: one engine per device, stages are clients).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specstream.errors import ContextLengthError, InvalidRequestError, ModelNotLoadedError
from specstream.types import SamplingParams
from specstream.schedulers.plan import Request, RequestStepResult, StepOutput, StepPlan, TokenDelta
from specstream.stages.speculative.executor import SpeculativeExecutor

TokenCallback = Callable[[Request, tuple[int, ...]], None]

_log = logging.getLogger("specstream.device_loop")

#: seconds of non-realtime prefill a device step may carry while realtime work is active (the loop's default)
REALTIME_PREFILL_BUDGET_S = 0.01
#: a model whose steps average longer waits while another model's realtime work is active (``QosConfig``)
REALTIME_STEP_BUDGET_S = 0.01


@dataclass
class ModelRunner:
    """One model of the device loop.

    Attributes:
        name: the model's name in requests (``Request.model``) and metrics.
        executor: its decoder, drafters and KV cache (:class:`SpeculativeExecutor`).
        tokenizer: a ``tokenizers.Tokenizer`` or None.
        eos_token_ids: tokens that end an output.
        max_len: context tokens per slot.
        requires_encoder_output: an encoder-decoder target (Whisper): every request needs an audio input.
    """

    name: str
    executor: SpeculativeExecutor
    tokenizer: Any = None
    eos_token_ids: tuple[int, ...] = ()
    max_len: int = 1024
    requires_encoder_output: bool = False
    reserved_realtime_slots: int = 0
    token_cost: float = 1.0
    encoder_bytes: int = 0  # memory budget allowance for the encoder outputs its requests hold
    _ids: Any = field(default_factory=itertools.count, repr=False)

    def limits(self):
        """The scheduler's view of this model (:class:`~specstream.schedulers.qos.ModelLimits`)."""
        from specstream.schedulers.qos import ModelLimits

        cache = self.executor.cache
        per_token = max(1, cache.nbytes() // (cache.num_slots * (cache.max_len + 1)))
        return ModelLimits(cache.num_slots, self.max_len, self.reserved_realtime_slots, per_token, self.token_cost)

    def memory_bytes(self) -> int:
        """What the model adds to the memory budget: its KV cache's token capacity and its encoder allowance."""
        lim = self.limits()
        return lim.num_slots * lim.max_len * lim.kv_bytes_per_token + self.encoder_bytes

    @property
    def vocab_size(self) -> int:
        return self.executor.target.config.vocab_size

    def register_encoder(self, modality: str, fn: Callable[[list], None]) -> None:
        """This model consumes ``modality`` inputs, encoded by ``fn`` (see ``SpeculativeExecutor.register_encoder``)."""
        self.executor.register_encoder(modality, fn)

    def set_prefill_hook(self, fn) -> None:
        """The one hook turning a request's encoder outputs into prefill inputs (``fn(state)``)."""
        self.executor.prefill_hook = fn

    def make_request(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                     request_id: str | None = None, speculate: bool = True, logits_processors: Sequence = (),
                     **kwargs) -> Request:
        """Validate and build a request for this model (not yet queued).

        Raises:
            InvalidRequestError: empty prompt, ids outside the vocabulary, ``max_new_tokens < 1``.
            ContextLengthError: the prompt leaves no room for a new token.
        """
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise InvalidRequestError("empty prompt: give at least one token id")
        vocab = self.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) >= self.max_len:
            raise ContextLengthError(
                f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_len} tokens "
                f"(prompt + at least one new token)")
        rid = request_id if request_id is not None else f"{self.name}-{next(self._ids)}"
        return Request(rid, prompt_ids, max_new_tokens, sampling or SamplingParams(),
                       kwargs.pop("eos_token_ids", self.eos_token_ids), speculate,
                       logits_processors=tuple(logits_processors), model=self.name, **kwargs)

    def decode_text(self, ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        limit = self.tokenizer.get_vocab_size(with_added_tokens=True)
        return self.tokenizer.decode([i for i in ids if i < limit])


@dataclass
class _Entry:
    """What the loop keeps about a request while it runs (dropped when it finishes)."""

    model: str
    on_tokens: TokenCallback | None = None
    future: Any = None  # a concurrent.futures.Future resolved with the finished request
    #: the caller's list that each step extends with the request's visual attention rows (None: not kept)
    visual_attention: list | None = None
    qos: str = "interactive"  # the request's QoS class, copied at submit (the step order reads it, not the scheduler)


class DeviceLoop:
    """Every model runner of one device, one scheduler, one step at a time.

    Args:
        runners: the models (names unique).
        scheduler: the scheduler (a ``QosScheduler`` whose models are the runners; a ``FifoScheduler`` only for a
            single runner).
        device: the device's name (thread name, registry key).
    """

    def __init__(self, runners: Sequence[ModelRunner] = (), scheduler=None, device: str = "cpu"):
        names = [r.name for r in runners]
        if len(set(names)) != len(names):
            raise ValueError(f"runner names must be unique, got {names}")
        self.runners: dict[str, ModelRunner] = {r.name: r for r in runners}
        if scheduler is None:
            scheduler = new_qos_scheduler()
            for r in runners:
                scheduler.add_model(r.name, r.limits(), r.memory_bytes())
                for modality in list(r.executor.mm_encoders) + list(r.executor.encoders):
                    scheduler.add_modality(modality)
        self.scheduler = scheduler
        self.device = device
        #: the loop's one record per request (its model, callback, future, visual attention list), added in
        #: ``add_request`` and removed in ``_end`` (or when a failed step fails the request): nothing else of the
        #: loop is kept per request
        self._entries: dict[str, _Entry] = {}
        self.steps = 0
        #: thread ident of every step taken (the one-loop test reads it)
        self.step_threads: set[int] = set()
        #: per model: seconds of device steps spent on its work (``/metrics``: ``..._device_seconds_total``)
        self.device_seconds: dict[str, float] = {}
        self._lock = threading.Condition()
        self._submitted: list[tuple[Request, _Entry, dict]] = []
        self._cancels: list[str] = []
        self._adds: list = []
        self._calls: list = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        #: the device thread has taken its last work (stopping): runners and calls are then applied inline, so a
        #: model that finishes loading during a shutdown neither waits forever nor is lost
        self._exited = False
        self.failed: dict[str, str] = {}  # model name -> why it could not be loaded (its endpoints are down)

    def add_runner(self, runner: ModelRunner) -> ModelRunner:
        """Serve one more model (thread-safe: applied between two steps when the loop runs).

        Raises:
            ValueError: a runner of that name exists.
        """
        if runner.name in self.runners:
            raise ValueError(f"a model named {runner.name!r} is already in the device loop")
        if not self.scheduler.multi_model:
            raise ValueError("this loop's scheduler serves one model")
        if self._thread is not None and threading.get_ident() != self._thread.ident:
            import concurrent.futures

            done: concurrent.futures.Future = concurrent.futures.Future()
            with self._lock:
                queued = not self._exited  # a thread that is ending takes no more: add it here instead
                if queued:
                    self._adds.append((runner, done))
                    self._lock.notify()
            if queued:
                done.result()
                return runner
        self._add_runner_now(runner)
        return runner

    def _add_runner_now(self, runner: ModelRunner) -> None:
        self.scheduler.add_model(runner.name, runner.limits(), runner.memory_bytes())
        for modality in list(runner.executor.mm_encoders) + list(runner.executor.encoders):
            self.scheduler.add_modality(modality)
        self.runners[runner.name] = runner
        self.failed.pop(runner.name, None)

    def call(self, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` on the device loop's thread, between two steps, and return its result (the
        caller's thread waits). Device work that is not a decoder step — an offline transcription's encoder
        window, a teacher-forced scoring forward, image-text embeddings — runs here, so it never overlaps a step.
        Inline when the loop is not started or when called from its own thread."""
        if self._thread is None or threading.get_ident() == self._thread.ident:
            return fn(*args, **kwargs)
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            queued = not self._exited
            if queued:
                self._calls.append((fn, args, kwargs, fut))
                self._lock.notify()
        if not queued:  # the thread has ended (stop): nothing else runs on the device now
            return fn(*args, **kwargs)
        return fut.result()

    def mark_failed(self, model: str, why: str) -> None:
        """Record that ``model`` could not be loaded: requests for it are refused naming why (``/readyz`` too)."""
        self.failed[model] = why

    # -- requests -------------------------------------------------------------------------------------------
    def runner(self, model: str) -> ModelRunner:
        """The runner named ``model``.

        Raises:
            ModelNotLoadedError: no such model (or it failed to load).
        """
        r = self.runners.get(model)
        if r is None:
            why = f": {self.failed[model]}" if model in self.failed else ""
            raise ModelNotLoadedError(f"model {model!r} is not loaded in this process{why} "
                                      f"(loaded: {', '.join(sorted(self.runners)) or 'none'})")
        return r

    def add_request(self, request: Request, on_tokens: TokenCallback | None = None, encoder_output=None,
                    visual_attention: list | None = None) -> Request:
        """Queue ``request`` now (from the loop's own thread, or when the loop is not started).

        ``on_tokens(request, new_tokens)`` is called after every step that commits tokens for it.
        ``visual_attention``: a list of the caller's that every step extends, per committed token, with the target's
        attention mass on the request's visual tokens (``[n_visual]`` float32 arrays; requests with a
        ``visual_span``); complete when the request finished. None: the rows are not kept (the loop holds none).

        Raises:
            ModelNotLoadedError, InvalidRequestError, CapacityError (the scheduler's admission control).
        """
        runner = self.runner(request.model)
        ex = runner.executor
        if encoder_output is not None and not hasattr(ex.target, "set_encoder_output"):
            raise InvalidRequestError("this target decoder takes no encoder output")
        if (runner.requires_encoder_output and encoder_output is None and not request.encodes
                and not request.mm_inputs):
            raise InvalidRequestError(f"model {runner.name!r} needs an encoder output per request (an audio input "
                                      f"in mm_inputs, or encoder_output=)")
        if request.request_id in self._entries:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.fork_of is not None and encoder_output is not None:
            raise InvalidRequestError("a fork shares its source's encoder output; give none of its own")
        self.scheduler.add(request)
        if encoder_output is not None:  # kept by the executor until the request's spec comes with a plan
            ex.encoder_outputs[request.request_id] = encoder_output
        self._entries[request.request_id] = _Entry(request.model, on_tokens, qos=request.qos,
                                                  visual_attention=visual_attention)
        return request

    def cancel(self, request_id: str) -> None:
        """Stop a request (its client went away): its slot is freed at the next step. Thread-safe."""
        if self._thread is not None and threading.get_ident() != self._thread.ident:
            with self._lock:
                self._cancels.append(request_id)
                self._lock.notify()
            return
        self._cancel_now(request_id)

    def _cancel_now(self, request_id: str) -> None:
        req = self.scheduler.cancel(request_id)
        if req is None:
            return
        self._end(req)

    def _end(self, req: Request) -> None:
        """A request finished (or was cancelled): its executor record goes unless a slot release is pending
        (then the release drops it), its entry goes, its future resolves."""
        entry = self._entries.pop(req.request_id, None)
        ex = self.runners[req.model].executor
        if req.slot is None or req.finish_reason == "cancelled" or req.error is not None:
            ex.drop(req.request_id)
        if entry is not None and entry.future is not None:
            self.scheduler.pop_finished(req.request_id)
            if not entry.future.done():
                entry.future.set_result(req)

    def pop(self, request_id: str) -> Request:
        """Forget a finished request (the caller has its output)."""
        self._entries.pop(request_id, None)
        return self.scheduler.pop_finished(request_id)

    # -- the step -------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def _model_of(self, request_id: str) -> str:
        entry = self._entries.get(request_id)
        if entry is not None:
            return entry.model
        req = self.scheduler.requests.get(request_id)
        return req.model if req is not None else next(iter(self.runners))

    def split(self, plan: StepPlan) -> dict[str, StepPlan]:
        """The plan's part for each model (encode batches go to the runner consuming their modality; each
        admitted spec to its model's runner)."""
        parts: dict[str, dict] = {name: {"prefills": [], "decodes": [], "released": [], "encodes": [],
                                         "preempted": [], "forks": [], "admitted": []} for name in self.runners}
        for spec in plan.admitted:
            parts[spec.model]["admitted"].append(spec)
        for p in plan.prefills:
            parts[p.model]["prefills"].append(p)
        for d in plan.decodes:
            parts[d.model]["decodes"].append(d)
        for rel in plan.released:  # SlotRelease: each names its model
            parts[rel.model]["released"].append(rel)
        for rel in plan.preempted:
            parts[rel.model]["preempted"].append(rel)
        for fw in plan.forks:
            parts[fw.model]["forks"].append(fw)
        for work in plan.encodes:
            owner = next((n for n, r in self.runners.items() if r.executor.handles(work.modality)), None)
            if owner is None:  # nobody encodes it: the executor answers with a clear error per item
                owner = self._model_of(work.items[0][0])
            parts[owner]["encodes"].append(work)
        return {name: StepPlan(plan.step, tuple(v["prefills"]), tuple(v["decodes"]), tuple(v["released"]),
                               tuple(v["encodes"]), tuple(v["preempted"]), tuple(v["forks"]), tuple(v["admitted"]))
                for name, v in parts.items()}

    def step(self) -> list[Request]:
        """One device step over every model; returns the requests that finished in it."""
        self.step_threads.add(threading.get_ident())
        plan = self.scheduler.schedule()
        parts = self.split(plan)
        # models with realtime rows run first: a subtitle window's tokens leave before a long caption forward
        entries = self._entries  # the loop's own records (QoS copied at submit), not the scheduler's requests
        order = sorted(parts, key=lambda n: (not any(getattr(entries.get(w.request_id), "qos", None) == "realtime"
                                                     for w in parts[n].prefills + parts[n].decodes), n))
        results: list[RequestStepResult] = []
        encoded = []
        forwards = nodes = 0
        duration = 0.0
        for name in order:
            part = parts[name]
            if not (part.prefills or part.decodes or part.encodes or part.released or part.preempted
                    or part.admitted):
                continue
            t0 = time.perf_counter()
            executor = self.runners[name].executor
            reused0 = executor.prefix_reused_tokens
            out: StepOutput = executor.execute(part)
            self.device_seconds[name] = self.device_seconds.get(name, 0.0) + (time.perf_counter() - t0)
            pre = sum(p.num_tokens for p in part.prefills)
            metrics = self.scheduler.metrics
            if metrics is not None:
                metrics.device_seconds.labels(name).inc(time.perf_counter() - t0)
                if pre:
                    metrics.prefill_tokens.labels(name).inc(pre)
                    metrics.prefix_reused_tokens.labels(name).inc(executor.prefix_reused_tokens - reused0)
            self.scheduler.observe(name, pre, pre + sum(d.node_budget for d in part.decodes), out.duration_s)
            results.extend(out.results)
            encoded.extend(out.encoded)
            forwards += out.target_forwards
            nodes += out.nodes_verified
            duration += out.duration_s
        output = StepOutput(plan.step, tuple(results), forwards, nodes, duration, tuple(encoded))
        finished = self.scheduler.update(output)
        self.steps += 1
        for res in output.results:
            entry = self._entries.get(res.request_id)
            if entry is None:
                continue
            if res.visual_attention and entry.visual_attention is not None:
                entry.visual_attention.extend(res.visual_attention)
            if entry.on_tokens is not None and (res.new_tokens or res.finish_reason or res.error):
                entry.on_tokens(self.scheduler.requests[res.request_id], res.new_tokens)
        for enc in output.encoded:  # a request failed by its encoder never reached a forward
            entry = self._entries.get(enc.request_id)
            req = self.scheduler.requests.get(enc.request_id)
            if enc.error and entry is not None and entry.on_tokens is not None and req is not None:
                entry.on_tokens(req, ())
        for req in finished:
            self._end(req)
        return finished

    def run(self) -> None:
        """Step until every queued request finished (the caller's thread)."""
        while self.has_work():
            self.step()

    # -- the device thread ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Run the steps in a dedicated thread; requests then come through :meth:`submit` /
        :meth:`submit_threadsafe`."""
        if self._thread is not None:
            return
        from specstream.threadpolicy import set_thread_policy

        set_thread_policy()  # torch is loaded by now: this reaches the child processes started from here on
        self._stopping = False
        self._exited = False
        self._thread = threading.Thread(target=self._main, name=f"specstream-device-{self.device}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish what was submitted, then stop the thread (``timeout``: give up waiting after that many s)."""
        if self._thread is None:
            return
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit_threadsafe(self, request: Request, on_tokens: TokenCallback | None = None,
                          on_admitted: Callable[[], None] | None = None, **add_kwargs):
        """Queue ``request`` from any thread; returns a ``concurrent.futures.Future`` resolved with the finished
        request (check ``.error``), or failed with the refusal (``CapacityError``, ``ModelNotLoadedError``, ...).
        ``on_tokens`` and ``on_admitted`` (once the scheduler took the request) run in the device thread."""
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._thread is None:
            raise RuntimeError("the device loop is not started")
        with self._lock:
            self._submitted.append((request, _Entry(request.model, on_tokens, future=fut), dict(add_kwargs,
                                                                                          _admitted=on_admitted)))
            self._lock.notify()
        return fut

    async def submit(self, request: Request, on_tokens: Callable[[TokenDelta], None] | None = None,
                     on_admitted: Callable[[], None] | None = None, **add_kwargs) -> Request:
        """Queue ``request`` from an asyncio task and wait for it to finish. ``on_tokens(delta)`` gets a
        :class:`~specstream.schedulers.plan.TokenDelta` per step that committed tokens (or ended the request),
        made on the device thread and run in the caller's event loop, in step order; ``on_admitted`` (once the
        scheduler took the request) runs there too. Cancelling the awaiting task cancels the request (its slot
        is freed).

        Raises:
            The refusal of the request (``CapacityError``, ``ModelNotLoadedError``, ``InvalidRequestError``).
        """
        aio = asyncio.get_running_loop()
        cb = None if on_tokens is None else (  # an immutable snapshot, never the live request
            lambda req, toks, _f=on_tokens: aio.call_soon_threadsafe(_f, TokenDelta.of(req, toks)))
        admitted = None if on_admitted is None else (lambda _f=on_admitted: aio.call_soon_threadsafe(_f))
        self.start()
        fut = self.submit_threadsafe(request, cb, admitted, **add_kwargs)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.cancel(request.request_id)
            raise

    def submit_group(self, requests: Sequence[Request], on_tokens: Sequence[Callable[[TokenDelta], None] | None],
                     on_admitted: Callable[[], None] | None = None) -> list:
        """Queue ``requests`` together from an asyncio task (the device thread takes all of them before its next
        step, in order) and return one awaitable per request, each as :meth:`submit`'s. This is how ``n`` choices
        of one prompt go in: the first is the source, the others name it in :attr:`Request.fork_of`, so the
        scheduler plans them as forks of its prefill. ``on_admitted`` runs once every request was taken.
        Cancelling an awaiting task cancels its request.

        Raises:
            ValueError: ``on_tokens`` does not give one entry per request.
        """
        if len(on_tokens) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(on_tokens)} on_tokens callbacks")
        import concurrent.futures

        aio = asyncio.get_running_loop()
        self.start()
        left = [len(requests)]

        def one_admitted() -> None:  # device thread
            left[0] -= 1
            if left[0] == 0 and on_admitted is not None:
                aio.call_soon_threadsafe(on_admitted)

        futs = []
        with self._lock:
            for req, cb in zip(requests, on_tokens):
                wrapped = None if cb is None else (
                    lambda r, toks, _f=cb: aio.call_soon_threadsafe(_f, TokenDelta.of(r, toks)))
                fut: concurrent.futures.Future = concurrent.futures.Future()
                self._submitted.append((req, _Entry(req.model, wrapped, future=fut), {"_admitted": one_admitted}))
                futs.append(fut)
            self._lock.notify()
        return [self._await(req, fut) for req, fut in zip(requests, futs)]

    async def _await(self, request: Request, fut) -> Request:
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.cancel(request.request_id)
            raise

    def _main(self) -> None:
        while True:
            with self._lock:
                submitted, self._submitted = self._submitted, []
                cancels, self._cancels = self._cancels, []
                adds, self._adds = self._adds, []
                calls, self._calls = self._calls, []
                stopping = self._stopping
            for fn, args, kwargs, fut in calls:
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    fut.set_exception(exc)
            for runner, done in adds:
                try:
                    self._add_runner_now(runner)
                    done.set_result(runner)
                except Exception as exc:
                    done.set_exception(exc)
            for req, entry, kw in submitted:
                admitted = kw.pop("_admitted", None)
                try:
                    self.add_request(req, entry.on_tokens, **kw)
                    self._entries[req.request_id].future = entry.future
                except Exception as exc:  # a refused request fails alone
                    entry.future.set_exception(exc)
                    continue
                if admitted is not None:
                    admitted()
            for rid in cancels:
                self._cancel_now(rid)
            if self.has_work():
                try:
                    self.step()
                except Exception as exc:  # a bug: every waiting request gets it, the loop goes on
                    self._fail_all(exc)
                continue
            if stopping:
                with self._lock:
                    if self._adds or self._calls:
                        continue  # queued while this iteration ran: apply them first
                    self._exited = True
                return
            with self._lock:
                if not (self._submitted or self._cancels or self._adds or self._calls or self._stopping):
                    nxt = self.scheduler.next_event_s()
                    timeout = None if nxt is None else max(0.0, nxt - self.scheduler.clock())
                    self._lock.wait(timeout)

    def _fail_all(self, exc: Exception) -> None:
        """A step raised (a bug): every request in flight fails with ``exc`` — its future raises, its ``on_tokens``
        sees ``error`` — and the loop goes on. Never a cancelled request resolved as a success: that was how an
        offline transcription in flight came back as an empty text (``docs/api.md``)."""
        _log.error("device step failed; failing the %d request(s) in flight", len(self._entries),
                   exc_info=(type(exc), exc, exc.__traceback__))
        error = {"code": getattr(exc, "code", "internal_error"), "message": f"device step failed: {exc}"}
        for rid, entry in list(self._entries.items()):
            fut = entry.future
            entry.future = None  # _end must not resolve it as a success
            req = self.scheduler.requests.get(rid)
            self._cancel_now(rid)
            self._entries.pop(rid, None)
            if req is not None:
                req.error, req.finish_reason = error, "error"
                if fut is not None:  # its waiter forgets it (as _end does for a finished one)
                    self.scheduler.pop_finished(rid)
            if entry.on_tokens is not None and req is not None:
                try:
                    entry.on_tokens(req, ())
                except Exception:  # a failing callback must not stop the others from failing
                    _log.exception("on_tokens of %s failed", rid)
            if fut is not None and not fut.done():
                fut.set_exception(exc)


def new_qos_scheduler(metrics=None, clock=time.monotonic, **config) -> Any:
    """A :class:`~specstream.schedulers.qos.QosScheduler` with no model yet and a memory budget in bytes that
    grows as runners join (``config``: :class:`~specstream.schedulers.qos.QosConfig` keys). While realtime work is
    active, a step carries at most ``REALTIME_PREFILL_BUDGET_S`` of other models' measured prefill time, and a
    model whose steps average more than ``REALTIME_STEP_BUDGET_S`` waits (at most ``MAX_DEFER_S``) while another
    model's realtime work is active."""
    from specstream.schedulers.qos import QosConfig, QosScheduler

    cfg = {"models": {}, "memory_budget_bytes": 0, "reserved_realtime_slots": 0,
           "realtime_prefill_budget_s": REALTIME_PREFILL_BUDGET_S, "realtime_step_budget_s": REALTIME_STEP_BUDGET_S,
           **config}
    return QosScheduler(QosConfig(**cfg), clock=clock, metrics=metrics)


_LOOPS: dict[str, DeviceLoop] = {}
_LOOPS_LOCK = threading.Lock()


def device_loop(device: str = "cpu", factory: Callable[[], DeviceLoop] | None = None) -> DeviceLoop:
    """The process's one loop for ``device`` (created by ``factory`` on first use).

    Raises:
        RuntimeError: no loop for the device yet and no factory.
    """
    with _LOOPS_LOCK:
        loop = _LOOPS.get(device)
        if loop is None:
            if factory is None:
                raise RuntimeError(f"no device loop for {device!r}")
            loop = _LOOPS[device] = factory()
        return loop


def release_device_loop(device: str = "cpu") -> None:
    """Stop and forget the process's loop for ``device`` (shutdown, tests)."""
    with _LOOPS_LOCK:
        loop = _LOOPS.pop(device, None)
    if loop is not None:
        loop.stop()
