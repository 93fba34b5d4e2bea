"""Video question answering: a video's keyframes, transcript and keyframe embeddings, then per question the frames,
the transcript excerpt and the answer. Plain values in, plain records out; no broker, topic or message schema.

:class:`VideoQA` does the work over a :class:`~specstream.stages.serving.ModelHub` (every model call goes through
it; QA work runs in the ``batch`` class). Its callers: ``specstream qa`` (``pipeline/qa_job.py``, called
directly), the worker's :class:`~specstream.pipeline.qa_stage.QaStage` (a broker consumer that turns the outcomes
into results) and ``specstream.answer``.

For a video, once (:meth:`VideoQA.video_context`): keyframes with PTS (the keyframe selector), the whole audio
track transcribed with segment times (a video without audio is answered from its frames), and, with a CLIP model
configured, an image embedding per keyframe. Then per question, in order (:meth:`VideoQA.answer`):

1. **frames** under the visual-token budget (``max_frames``, ``max_visual_tokens``, and the model's context):
   without CLIP, spread over the scenes (:func:`spread_indices`); with CLIP, the keyframes most similar to the
   question (:func:`top_k_indices`); shown in time order;
2. **transcript excerpt**: the segments nearest in time to the chosen frames, as many as fit
   ``max_transcript_tokens`` and the context, in time order;
3. **answer**: the VLM target sees the frames (a multi-image prompt), the excerpt and the question; drafts come
   from the text draft, n-gram lookup over the prompt (transcript and question) and the previous answer of the
   video (temporal drafter). With ``answer_with="text"`` a text model answers from the excerpt alone.

:meth:`VideoQA.answer_video` runs a whole video: one outcome per question, in order (a record, or the exception
that question ended with; a video that cannot be decoded gives every question that error).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specstream.errors import EmptyQuestionError, NoTranscriptError, SpecstreamError, UnsupportedMediaError
from specstream.stages.caption import MAX_SOURCE_BYTES
from specstream.stages.serving import QOS_BATCH, GenerationParams, ModelHub, Prompt, Transcription, Turn

log = logging.getLogger("specstream.qa")

QUESTION_PROMPT = "{frames}{transcript}Question: {question}\nAnswer briefly."
TEXT_PROMPT = ("Answer the question about a video from the transcript of its audio.\n"
               "{transcript}Question: {question}\nAnswer briefly.")
SLACK_TOKENS = 8  # room kept in the context beyond prompt + max_new_tokens (template differences, rounding)


@dataclass
class QaOptions:
    """Per-question limits and model choice. Any object with these attributes reads the same (the ``video_qa``
    message's ``QaParams`` is passed as it is)."""

    max_frames: int = 4
    max_visual_tokens: int | None = None
    max_new_tokens: int = 32
    max_transcript_tokens: int = 256
    use_transcript: bool = True
    answer_with: str = "vlm"  # "vlm", or "text": the text model answers from the transcript alone
    max_keyframes_per_minute: float | None = None
    schema: dict[str, Any] | None = None  # every answer follows this JSON Schema

    def params(self) -> dict[str, Any]:
        """The fields as a dict (a ``video_qa`` request's params)."""
        return {"max_frames": self.max_frames, "max_visual_tokens": self.max_visual_tokens,
                "max_new_tokens": self.max_new_tokens, "max_transcript_tokens": self.max_transcript_tokens,
                "use_transcript": self.use_transcript, "answer_with": self.answer_with,
                "max_keyframes_per_minute": self.max_keyframes_per_minute, "schema": self.schema}


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


class VideoQA:
    """Answers questions about videos over ``hub`` (see the module docstring). ``stats`` adds up, over every
    video: videos, questions, answered, failed, tokens, target_steps, and the seconds of keyframes,
    transcription, embedding and decoding."""

    def __init__(self, hub: ModelHub):
        self.hub = hub
        self.stats = {"videos": 0, "questions": 0, "answered": 0, "failed": 0, "tokens": 0, "target_steps": 0,
                      "keyframes_s": 0.0, "transcription_s": 0.0, "embedding_s": 0.0, "decode_s": 0.0}

    async def answer_video(self, path: str | None, shown: str, questions: Sequence, options: QaOptions,
                           video_id: str, allowed_roots: list[Path] | None = None,
                           max_source_bytes: int = MAX_SOURCE_BYTES,
                           error: SpecstreamError | None = None) -> AsyncIterator[tuple[int, dict[str, Any] |
                                                                                       Exception]]:
        """Answer a video's questions in order: ``(index, outcome)`` per question, as each is answered. The
        outcome is the answer's record (:meth:`answer`'s) or the exception the question ended with (an empty
        question, the video's error, a failed answer); the next question then drafts from nothing.

        Args:
            path: the video on disk, opened here once (only when some question is not empty); None with ``error``.
            shown: the video's name in error messages.
            questions: objects with ``id``, ``text`` and ``draft_tokens`` (None: draft from the previous answer).
            allowed_roots, max_source_bytes: the open's checks (``modalities.source.open_source``).
            error: the video could not even be found: every non-empty question ends with it.
        """
        from specstream.modalities.source import name_fd_paths, open_source

        self.stats["videos"] += 1
        ctx: VideoContext | None = None
        media_error = error
        if any(q.text.strip() for q in questions) and media_error is None:
            opened = None
            try:
                opened = open_source(path, allowed_roots, max_source_bytes)
                ctx = await self.video_context(opened.path, shown, options)
            except SpecstreamError as exc:
                media_error = exc
            finally:
                if opened is not None:
                    opened.close()
        if media_error is not None:
            media_error.message = name_fd_paths(media_error.message, shown)
        previous: list[int] | None = None
        for i, q in enumerate(questions):
            self.stats["questions"] += 1
            try:
                if not q.text.strip():
                    raise EmptyQuestionError(f"question {q.id!r} of video {video_id!r} is empty")
                if media_error is not None:
                    raise media_error
                hyp = q.draft_tokens if q.draft_tokens is not None else previous
                record, previous = await self.answer(ctx, q.text, options, hypothesis=hyp)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not isinstance(exc, SpecstreamError):
                    log.exception("video %s question %s failed", video_id, q.id)
                self.stats["failed"] += 1
                previous = None
                yield i, exc
                continue
            self.stats["answered"] += 1
            yield i, record

    async def video_context(self, path: str, shown: str, options: QaOptions) -> VideoContext:
        """Keyframes, transcript and keyframe embeddings of one opened video (``path`` as opened).

        Raises:
            MediaError subclasses (the video cannot be decoded), UnsupportedMediaError (no keyframes).
        """
        t0 = time.perf_counter()
        keyframes = await self.hub.keyframes(path, max_keyframes_per_minute=options.max_keyframes_per_minute)
        self.stats["keyframes_s"] += time.perf_counter() - t0
        if not keyframes:
            raise UnsupportedMediaError(f"{shown}: no frames")
        audio = "none"
        tr = Transcription((), "en", 0.0, has_audio=False)
        if options.use_transcript or options.answer_with == "text":
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

    async def choose_frames(self, ctx: VideoContext, question: str, options: QaOptions, pick=None) -> list[int]:
        """Indices of the keyframes shown for ``question`` (time order): at most ``max_frames``, and for the VLM at
        most ``max_visual_tokens`` visual tokens (the context is checked by :meth:`answer`). ``pick``: a
        :meth:`frame_picker` already made for the question."""
        pick = pick or await self.frame_picker(ctx, question)
        k = min(options.max_frames, len(ctx.keyframes))
        if options.answer_with == "vlm" and options.max_visual_tokens is not None:
            while k > 1:
                images = [ctx.keyframes[i].image for i in pick(k)]
                _, visual = await self.hub.count_prompt(Prompt(turns=(Turn("user", (*images, question)),)))
                if visual <= options.max_visual_tokens:
                    break
                k -= 1
        return pick(k)

    async def answer(self, ctx: VideoContext, question: str, options: QaOptions,
                     hypothesis: list[int] | None = None) -> tuple[dict[str, Any], list[int]]:
        """Answer one question about a prepared video: (``{"answer", "frames", "transcript_used", "tokens",
        "stats"}``, the answer's tokens to draft the next answer from).

        Raises:
            ContextLengthError: not even one frame and the question fit the context with ``max_new_tokens``.
            NoTranscriptError: a text model answers and the video has no transcript.
        """
        kind = options.answer_with
        pick = await self.frame_picker(ctx, question)
        chosen = await self.choose_frames(ctx, question, options, pick)
        context = await self.hub.context_length(kind=kind)
        lines: list[str] = []
        while True:  # fewer frames until the prompt without transcript leaves room for the answer
            prompt = self._prompt(ctx, chosen, question, [], kind)
            n, _ = await self.hub.count_prompt(prompt, kind=kind)
            if n + options.max_new_tokens + SLACK_TOKENS <= context or len(chosen) <= 1 or kind == "text":
                break
            chosen = pick(len(chosen) - 1)
        room = min(options.max_transcript_tokens, context - n - options.max_new_tokens - SLACK_TOKENS)
        if options.use_transcript or kind == "text":
            lines = await self._excerpt(ctx, chosen, room, kind)
        if kind == "text" and not lines:
            raise NoTranscriptError(f"{ctx.source}: no transcript to answer from (audio: {ctx.audio})")
        if lines:
            prompt = self._prompt(ctx, chosen, question, lines, kind)
        t0 = time.perf_counter()
        gen = await self.hub.generate(prompt, GenerationParams(max_new_tokens=options.max_new_tokens), kind=kind,
                                      qos=QOS_BATCH, hypothesis=hypothesis, schema=options.schema)
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
        if options.schema is not None:  # the parsed JSON value (the partial text when the token limit cut it)
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
