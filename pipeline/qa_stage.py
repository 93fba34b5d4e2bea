"""The broker-facing consumer of ``video_qa``, ``transcribe`` and ``generate`` requests: messages in, results out.

:class:`QaStage` consumes them from ``specstream.requests`` and publishes
:class:`~specstream.pipeline.messages.PipelineResult` s on ``specstream.results``, on a
:class:`~specstream.pipeline.broker.Broker` (Kafka in ``specstream worker``); :meth:`QaStage.handle` answers one
request with no broker (its results handed to a function). It parses the message, opens the source, and turns
outcomes into result records; the answering itself is :class:`~specstream.stages.qa.VideoQA`'s (frames, transcript
excerpt, token budgets, the answer), which ``specstream qa`` calls directly. Every model call goes through
:class:`~specstream.stages.serving.ModelHub`.

A ``video_qa`` request gives one result per question (``seq`` = the question's index, ``final`` on the last),
published as it is answered; a question that fails gets an error result and the others go on; a video that cannot
be decoded gives every question that error. The message is acknowledged after its last result was published
(at-least-once; results are idempotent by (``id``, ``seq``): greedy answers and their stats repeat exactly).
"""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import aclosing
from pathlib import Path

from specstream.errors import (
    InvalidRequestError,
    SchemaViolationError,
    SpecstreamError,
    UnsupportedMediaError,
    UnsupportedTaskError,
)
from specstream.pipeline.broker import TOPIC_REQUESTS, TOPIC_RESULTS, Broker, Message, consume
from specstream.pipeline.caption_stages import error_info, resolve_source
from specstream.pipeline.messages import (
    ErrorInfo,
    GenerateParams,
    PipelineRequest,
    PipelineResult,
    QaParams,
    TranscribeParams,
)
from specstream.stages.caption import MAX_SOURCE_BYTES
from specstream.stages.qa import VideoQA
from specstream.stages.serving import GenerationParams, ModelHub, Prompt, Turn

log = logging.getLogger("specstream.qa")

QA_TASKS = ("video_qa", "transcribe", "generate")


class QaStage:
    """Answers ``video_qa``, ``transcribe`` and ``generate`` requests (see the module docstring).

    Args:
        broker: the graph's broker (requests in, results out).
        hub: the models.
        allowed_roots: directories sources must lie in (None: any path; the command line's own inputs).
        concurrency: requests handled at once (videos decode and transcribe meanwhile; questions of one video are
            answered in order, each drafted from the previous answer).
        max_source_bytes: size limit of a source.
    """

    def __init__(self, broker: Broker | None, hub: ModelHub, allowed_roots: list[Path] | None = None,
                 concurrency: int = 2, max_source_bytes: int = MAX_SOURCE_BYTES, emit=None):
        self.broker = broker
        self.emit = emit  # ``await emit(result)`` instead of publishing on the broker (no broker: ``handle``)
        self.hub = hub
        self.qa = VideoQA(hub)  # the answering (stages/qa.py)
        self.stats = self.qa.stats
        self.allowed_roots = allowed_roots
        self.sem = asyncio.Semaphore(max(1, concurrency))
        self.max_source_bytes = max_source_bytes

    async def run(self) -> None:
        await consume(self.broker, TOPIC_REQUESTS, self.sem, self._handle_message)

    async def _handle_message(self, msg: Message) -> None:
        req: PipelineRequest = msg.value
        published: set[int] = set()
        try:
            if not msg.revoked:
                await self._handle(req, published)
        except Exception as exc:  # every failure ends as the request's error result(s)
            if not isinstance(exc, SpecstreamError):
                log.exception("request %s failed", req.id)
            if not await self._publish_errors(req, published, exc):
                msg.fail()
                return
        msg.done()

    async def handle(self, req: PipelineRequest) -> None:
        """Answer one request with no broker: its results go to ``emit`` (given at construction), as they would be
        published; whatever fails ends as the request's error results, as on the broker.

        Raises:
            RuntimeError: even the error results could not be emitted (``emit`` raised)."""
        published: set[int] = set()
        async with self.sem:
            try:
                await self._handle(req, published)
            except Exception as exc:
                if not isinstance(exc, SpecstreamError):
                    log.exception("request %s failed", req.id)
                if not await self._publish_errors(req, published, exc):
                    raise RuntimeError(f"request {req.id}: its error results could not be emitted") from exc

    # -- results ----------------------------------------------------------------------------------------------------
    def _seqs(self, req: PipelineRequest) -> list[int]:
        if req.task == "video_qa":
            try:
                return list(range(len(QaParams(**req.params).questions)))
            except Exception:
                return [0]
        return [0]

    async def _publish(self, req: PipelineRequest, seq: int, last: int, output: dict | None,
                       error: ErrorInfo | None = None) -> None:
        res = PipelineResult(id=req.id, status="error" if error is not None else "ok", output=output, error=error,
                             seq=seq, final=seq == last)
        if self.emit is not None:
            await self.emit(res)
        else:
            await self.broker.publish(TOPIC_RESULTS, req.id, res)

    async def _publish_errors(self, req: PipelineRequest, published: set[int], exc: BaseException) -> bool:
        """``exc`` as the error result of every result not yet published; False when that failed too."""
        info = error_info(exc)
        seqs = self._seqs(req)
        try:
            params = QaParams(**req.params) if req.task == "video_qa" else None
        except Exception:
            params = None
        try:
            for seq in seqs:
                if seq in published:
                    continue
                out = None
                if params is not None:
                    out = {"id": params.video_id or req.id, "question_id": params.questions[seq].id,
                           "video": self._display(req)}
                    self.stats["failed"] += 1
                await self._publish(req, seq, seqs[-1], out, info)
                published.add(seq)
            return True
        except Exception:
            log.exception("request %s: the error results could not be published (left uncommitted)", req.id)
            return False

    @staticmethod
    def _display(req: PipelineRequest) -> str:
        src = req.source
        if src is None:
            return ""
        return src.uri or src.filename or f"inline:{req.id}"

    # -- dispatch -----------------------------------------------------------------------------------------------------
    async def _handle(self, req: PipelineRequest, published: set[int]) -> None:
        tasks = {"video_qa": (QaParams, self._video_qa), "transcribe": (TranscribeParams, self._transcribe),
                 "generate": (GenerateParams, self._generate)}
        if req.task not in tasks:
            raise UnsupportedTaskError(f"task {req.task!r} is not served by this stage (served: "
                                       f"{', '.join(QA_TASKS)})")
        schema, run = tasks[req.task]
        try:
            params = schema(**req.params)
        except Exception as exc:
            raise SchemaViolationError(f"params: {exc}") from None
        if req.task == "video_qa":
            await run(req, params, published)  # one result per question, booked as each is published
        else:
            await run(req, params)
            published.add(0)

    async def _open(self, req: PipelineRequest):
        """(opened source, its display name, temporary file or None)."""
        from specstream.modalities.source import open_source

        path, shown, tmp = resolve_source(req, self.allowed_roots, self.max_source_bytes)
        try:
            opened = open_source(path, None if tmp else self.allowed_roots, self.max_source_bytes)
        except BaseException:
            if tmp:
                os.unlink(tmp)
            raise
        return opened, shown, tmp

    # -- video_qa -----------------------------------------------------------------------------------------------------
    async def _video_qa(self, req: PipelineRequest, params: QaParams, published: set[int]) -> None:
        last = len(params.questions) - 1
        video_id = params.video_id or req.id
        path, shown, tmp, error = None, self._display(req), None, None
        if any(q.text.strip() for q in params.questions):
            try:
                path, shown, tmp = resolve_source(req, self.allowed_roots, self.max_source_bytes)
            except SpecstreamError as exc:
                error = exc
        try:
            outcomes = self.qa.answer_video(path, shown, params.questions, params, video_id,
                                            None if tmp else self.allowed_roots, self.max_source_bytes, error)
            async with aclosing(outcomes):
                async for i, outcome in outcomes:
                    base = {"id": video_id, "question_id": params.questions[i].id, "video": shown}
                    if isinstance(outcome, Exception):
                        await self._publish(req, i, last, base, error_info(outcome))
                    else:
                        await self._publish(req, i, last, {**base, **outcome})
                    published.add(i)
        finally:
            if tmp:
                os.unlink(tmp)

    # -- transcribe and generate ------------------------------------------------------------------------------------
    async def _transcribe(self, req: PipelineRequest, params: TranscribeParams) -> None:
        opened = tmp = None
        try:
            opened, shown, tmp = await self._open(req)
            tr = await self.hub.transcribe(opened.path, language=params.language, qos=req.qos)
        finally:
            if opened is not None:
                opened.close()
            if tmp:
                os.unlink(tmp)
        out = {"source": shown, "language": tr.language, "duration_s": round(tr.duration_s, 3),
               "has_audio": tr.has_audio, "text": tr.text,
               "segments": [{"start_s": round(s.start_s, 3), "end_s": round(s.end_s, 3), "text": s.text.strip()}
                            for s in tr.segments]}
        await self._publish(req, 0, 0, out)

    async def _generate(self, req: PipelineRequest, params: GenerateParams) -> None:
        images: tuple = ()
        if req.source is not None:
            from specstream.modalities.image import load_image
            from specstream.stages.caption import media_kind

            opened = tmp = None
            try:
                opened, shown, tmp = await self._open(req)
                kind = await asyncio.to_thread(media_kind, opened.path, req.source.filename or shown)
                if kind != "image":
                    raise UnsupportedMediaError(f"{shown}: generate takes an image source, not a {kind}")
                images = (await asyncio.to_thread(load_image, opened.path),)
            finally:
                if opened is not None:
                    opened.close()
                if tmp:
                    os.unlink(tmp)
        if params.chat:
            prompt = Prompt(turns=(Turn("user", (*images, params.prompt)),))
        elif images:
            raise InvalidRequestError("an image source needs chat=true (the chat template places the image)")
        else:
            prompt = Prompt(text=params.prompt)
        gen = await self.hub.generate(prompt, GenerationParams(max_new_tokens=params.max_new_tokens,
                                                               temperature=params.temperature, top_p=params.top_p,
                                                               seed=params.seed), kind=params.model, qos=req.qos)
        out = {"model": gen.model, "text": gen.text, "tokens": gen.tokens, "finish_reason": gen.finish_reason,
               "usage": {"prompt_tokens": gen.prompt_tokens, "completion_tokens": len(gen.tokens),
                         "total_tokens": gen.prompt_tokens + len(gen.tokens)},
               "stats": gen.stats}
        await self._publish(req, 0, 0, out)
