"""Video question answering, transcription and text generation as a stage: requests in, results out.

:class:`QaStage` consumes ``video_qa``, ``transcribe`` and ``generate`` requests from ``specstream.requests`` and
publishes :class:`~specstream.pipeline.messages.PipelineResult` s on ``specstream.results``, on a
:class:`~specstream.pipeline.broker.Broker` (Kafka in ``specstream worker``); ``specstream qa`` calls
:meth:`QaStage.handle` directly, with no broker, and gets the same results.
Every model call goes through :class:`~specstream.stages.serving.ModelHub`; QA work runs in the ``batch`` class.

A ``video_qa`` request names one video and its questions. For the video, once: keyframes with PTS (the keyframe
selector), the whole audio track transcribed with segment times (a video without audio is answered from its
frames), and, with a CLIP model configured, an image embedding per keyframe. Then per question, in order:

1. **frames** under the visual-token budget (``max_frames``, ``max_visual_tokens``, and the model's context):
   without CLIP, spread over the scenes (:func:`spread_indices`); with CLIP, the keyframes most similar to the
   question (:func:`top_k_indices`); shown in time order;
2. **transcript excerpt**: the segments nearest in time to the chosen frames, as many as fit
   ``max_transcript_tokens`` and the context, in time order;
3. **answer**: the VLM target sees the frames (a multi-image prompt), the excerpt and the question; drafts come
   from the text draft, n-gram lookup over the prompt (transcript and question) and the previous answer of the
   video (temporal drafter). With ``answer_with="text"`` a text model answers from the excerpt alone.

One result per question (``seq`` = the question's index, ``final`` on the last), published as it is answered; a
question that fails gets an error result and the others go on; a video that cannot be decoded gives every
question that error. The message is acknowledged after its last result was published (at-least-once; results are
idempotent by (``id``, ``seq``): greedy answers and their stats repeat exactly).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specstream.errors import (
    EmptyQuestionError,
    InvalidRequestError,
    NoTranscriptError,
    SchemaViolationError,
    SpecstreamError,
    UnsupportedMediaError,
    UnsupportedTaskError,
)
from specstream.pipeline.broker import TOPIC_REQUESTS, TOPIC_RESULTS, Broker, Message, consume
from specstream.pipeline.messages import (
    ErrorInfo,
    GenerateParams,
    PipelineRequest,
    PipelineResult,
    QaParams,
    TranscribeParams,
)
from specstream.stages.caption import MAX_SOURCE_BYTES
from specstream.stages.serving import (
    QOS_BATCH,
    GenerationParams,
    ModelHub,
    Prompt,
    Transcription,
    Turn,
)

log = logging.getLogger("specstream.qa")

QA_TASKS = ("video_qa", "transcribe", "generate")
QUESTION_PROMPT = "{frames}{transcript}Question: {question}\nAnswer briefly."
TEXT_PROMPT = ("Answer the question about a video from the transcript of its audio.\n"
               "{transcript}Question: {question}\nAnswer briefly.")
SLACK_TOKENS = 8  # room kept in the context beyond prompt + max_new_tokens (template differences, rounding)


def spread_indices(n: int, k: int) -> list[int]:
    """``k`` of ``n`` keyframe indices spread over the video's scenes: the middle keyframe of each of ``k`` equal
    runs of keyframes (all of them when ``k >= n``), ascending."""
    if k >= n:
        return list(range(n))
    return sorted({min(n - 1, int((i + 0.5) * n / k)) for i in range(k)})


def top_k_indices(similarities: np.ndarray, k: int) -> list[int]:
    """The indices of the ``k`` largest similarities (ties: the earlier keyframe), returned in time order."""
    order = np.argsort(-np.asarray(similarities, dtype=np.float64), kind="stable")
    return sorted(int(i) for i in order[:k])


def format_segment(start_s: float, end_s: float, text: str) -> str:
    return f"[{start_s:.1f}-{end_s:.1f} s] {text.strip()}"


@dataclass
class VideoContext:
    """What a video's questions share: its keyframes, transcript and (with CLIP) keyframe embeddings."""

    source: str
    keyframes: list
    transcription: Transcription
    audio: str  # "ok", "none" (no audio stream) or "error: <code>" (answered from the frames)
    embeddings: np.ndarray | None = None


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
        self.allowed_roots = allowed_roots
        self.sem = asyncio.Semaphore(max(1, concurrency))
        self.max_source_bytes = max_source_bytes
        self.stats = {"videos": 0, "questions": 0, "answered": 0, "failed": 0, "tokens": 0, "target_steps": 0,
                      "keyframes_s": 0.0, "transcription_s": 0.0, "embedding_s": 0.0, "decode_s": 0.0}

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
        from specstream.pipeline.caption_stages import error_info

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
        from specstream.pipeline.caption_stages import resolve_source

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
        from specstream.modalities.source import name_fd_paths

        last = len(params.questions) - 1
        video_id = params.video_id or req.id
        shown = self._display(req)
        valid = [i for i, q in enumerate(params.questions) if q.text.strip()]
        self.stats["videos"] += 1
        ctx: VideoContext | None = None
        media_error: SpecstreamError | None = None
        if valid:
            opened = tmp = None
            try:
                opened, shown, tmp = await self._open(req)
                ctx = await self.video_context(opened.path, shown, params)
            except SpecstreamError as exc:
                media_error = exc
                media_error.message = name_fd_paths(exc.message, shown)
            finally:
                if opened is not None:
                    opened.close()
                if tmp:
                    os.unlink(tmp)
        previous: list[int] | None = None
        for i, q in enumerate(params.questions):
            base = {"id": video_id, "question_id": q.id, "video": shown}
            self.stats["questions"] += 1
            try:
                if not q.text.strip():
                    raise EmptyQuestionError(f"question {q.id!r} of video {video_id!r} is empty")
                if media_error is not None:
                    raise media_error
                hyp = q.draft_tokens if q.draft_tokens is not None else previous
                record, previous = await self.answer(ctx, q.text, params, hypothesis=hyp)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                from specstream.pipeline.caption_stages import error_info

                if not isinstance(exc, SpecstreamError):
                    log.exception("video %s question %s failed", video_id, q.id)
                self.stats["failed"] += 1
                previous = None
                await self._publish(req, i, last, base, error_info(exc))
                published.add(i)
                continue
            record = {**base, **record}
            self.stats["answered"] += 1
            await self._publish(req, i, last, record)
            published.add(i)

    async def video_context(self, path: str, shown: str, params: QaParams) -> VideoContext:
        """Keyframes, transcript and keyframe embeddings of one opened video (``path`` as opened).

        Raises:
            MediaError subclasses (the video cannot be decoded), UnsupportedMediaError (no keyframes).
        """
        import time

        t0 = time.perf_counter()
        keyframes = await self.hub.keyframes(path, max_keyframes_per_minute=params.max_keyframes_per_minute)
        self.stats["keyframes_s"] += time.perf_counter() - t0
        if not keyframes:
            raise UnsupportedMediaError(f"{shown}: no frames")
        audio = "none"
        tr = Transcription((), "en", 0.0, has_audio=False)
        if params.use_transcript or params.answer_with == "text":
            t0 = time.perf_counter()
            try:
                tr = await self.hub.transcribe(path, qos=QOS_BATCH)
                audio = "ok" if tr.has_audio else "none"
            except SpecstreamError as exc:  # the frames still answer; the line says why there is no transcript
                log.warning("%s: audio not transcribed: %s", shown, exc.message)
                audio = f"error: {exc.code}"
            self.stats["transcription_s"] += time.perf_counter() - t0
        emb = None
        if self.hub.has_clip:
            t0 = time.perf_counter()
            emb = await self.hub.image_embeddings([k.image for k in keyframes])
            self.stats["embedding_s"] += time.perf_counter() - t0
        return VideoContext(shown, keyframes, tr, audio, emb)

    async def frame_picker(self, ctx: VideoContext, question: str):
        """A function ``k -> keyframe indices`` (time order) for ``question``: spread over the scenes, or with CLIP
        embeddings the ``k`` keyframes most similar to the question."""
        n = len(ctx.keyframes)
        if ctx.embeddings is None:
            return lambda k: spread_indices(n, k)
        ranked = ctx.embeddings @ await self.hub.text_embedding(question)
        return lambda k: top_k_indices(ranked, k)

    async def choose_frames(self, ctx: VideoContext, question: str, params: QaParams, pick=None) -> list[int]:
        """Indices of the keyframes shown for ``question`` (time order): at most ``max_frames``, and for the VLM at
        most ``max_visual_tokens`` visual tokens (the context is checked by :meth:`answer`). ``pick``: a
        :meth:`frame_picker` already made for the question."""
        pick = pick or await self.frame_picker(ctx, question)
        k = min(params.max_frames, len(ctx.keyframes))
        if params.answer_with == "vlm" and params.max_visual_tokens is not None:
            while k > 1:
                images = [ctx.keyframes[i].image for i in pick(k)]
                _, visual = await self.hub.count_prompt(Prompt(turns=(Turn("user", (*images, question)),)))
                if visual <= params.max_visual_tokens:
                    break
                k -= 1
        return pick(k)

    async def answer(self, ctx: VideoContext, question: str, params: QaParams,
                     hypothesis: list[int] | None = None) -> tuple[dict[str, Any], list[int]]:
        """Answer one question about a prepared video: (``{"answer", "frames", "transcript_used", "tokens",
        "stats"}``, the answer's tokens to draft the next answer from).

        Raises:
            ContextLengthError: not even one frame and the question fit the context with ``max_new_tokens``.
            NoTranscriptError: a text model answers and the video has no transcript.
        """
        import time

        kind = params.answer_with
        pick = await self.frame_picker(ctx, question)
        chosen = await self.choose_frames(ctx, question, params, pick)
        context = await self.hub.context_length(kind=kind)
        lines: list[str] = []
        while True:  # fewer frames until the prompt without transcript leaves room for the answer
            prompt = self._prompt(ctx, chosen, question, [], kind)
            n, _ = await self.hub.count_prompt(prompt, kind=kind)
            if n + params.max_new_tokens + SLACK_TOKENS <= context or len(chosen) <= 1 or kind == "text":
                break
            chosen = pick(len(chosen) - 1)
        room = min(params.max_transcript_tokens, context - n - params.max_new_tokens - SLACK_TOKENS)
        if params.use_transcript or kind == "text":
            lines = await self._excerpt(ctx, chosen, room, kind)
        if kind == "text" and not lines:
            raise NoTranscriptError(f"{ctx.source}: no transcript to answer from (audio: {ctx.audio})")
        if lines:
            prompt = self._prompt(ctx, chosen, question, lines, kind)
        t0 = time.perf_counter()
        gen = await self.hub.generate(prompt, GenerationParams(max_new_tokens=params.max_new_tokens), kind=kind,
                                      qos=QOS_BATCH, hypothesis=hypothesis, schema=params.schema)
        self.stats["decode_s"] += time.perf_counter() - t0
        self.stats["tokens"] += len(gen.tokens)
        self.stats["target_steps"] += gen.stats["target_steps"]
        record = {"answer": gen.text.strip(),
                  "frames": [{"timestamp_s": round(float(ctx.keyframes[i].timestamp_s), 6),
                              "frame_index": int(ctx.keyframes[i].frame_index)} for i in chosen],
                  "transcript_used": bool(lines), "tokens": list(gen.tokens),
                  "stats": {**gen.stats, "model": gen.model, "prompt_tokens": gen.prompt_tokens,
                            "visual_tokens": gen.visual_tokens, "transcript_segments": len(lines),
                            "audio": ctx.audio, "finish_reason": gen.finish_reason}}
        if params.schema is not None:  # the parsed JSON value (the partial text when the token limit cut it)
            from specstream.stages.speculative.grammar import structured_output

            record["answer"], _ = structured_output(gen.text, "eos" if gen.finish_reason == "stop"
                                                    else gen.finish_reason)
        draft = gen.tokens[:-1] if gen.finish_reason == "stop" else list(gen.tokens)  # without the end token
        return record, draft

    @staticmethod
    def _prompt(ctx: VideoContext, chosen: list[int], question: str, lines: list[str], kind: str) -> Prompt:
        transcript = ("Transcript of the audio:\n" + "\n".join(lines) + "\n") if lines else ""
        if kind == "text":
            return Prompt(turns=(Turn("user", (TEXT_PROMPT.format(transcript=transcript, question=question),)),))
        stamps = ", ".join(f"{float(ctx.keyframes[i].timestamp_s):.1f}" for i in chosen)
        frames = f"Frames at {stamps} s.\n" if chosen else ""
        text = QUESTION_PROMPT.format(frames=frames, transcript=transcript, question=question)
        images = tuple(ctx.keyframes[i].image for i in chosen)
        return Prompt(turns=(Turn("user", (*images, text)),))

    async def _excerpt(self, ctx: VideoContext, chosen: list[int], room: int, kind: str) -> list[str]:
        """Transcript lines nearest in time to the chosen frames that fit ``room`` tokens, in time order."""
        segs = [s for s in ctx.transcription.segments if s.text.strip()]
        if not segs or room <= 0:
            return []
        stamps = [float(ctx.keyframes[i].timestamp_s) for i in chosen] or [0.0]

        def distance(s) -> float:
            return min(0.0 if s.start_s <= t <= s.end_s else min(abs(t - s.start_s), abs(t - s.end_s))
                       for t in stamps)

        order = sorted(range(len(segs)), key=lambda j: (distance(segs[j]), j))
        keep: list[int] = []
        used = 0
        for j in order:
            line = format_segment(segs[j].start_s, segs[j].end_s, segs[j].text)
            cost = await self.hub.count_text(line + "\n", kind=kind)
            if used + cost > room:
                continue
            keep.append(j)
            used += cost
        return [format_segment(segs[j].start_s, segs[j].end_s, segs[j].text) for j in sorted(keep)]

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
