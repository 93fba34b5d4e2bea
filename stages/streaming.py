"""Streaming speech recognition: live subtitles from audio chunks (whisper_streaming's online processor, with
Whisper's decoder in the speculative engine).

One contract for every driver (a WebSocket session, a file replayed on a simulated clock, a benchmark):
:meth:`StreamingRecognizer.insert_audio` (16 kHz mono float32, any chunk size), :meth:`~StreamingRecognizer.process`
(one decoding pass when :meth:`~StreamingRecognizer.ready`) and :meth:`~StreamingRecognizer.finish`; each returns
typed :class:`Subtitle` s. Only committed text leaves the stage as ``final``, once; the rest is ``partial``.

How a pass works:

1. The audio lives in a :class:`RingBuffer` (16 kHz float32, absolute sample positions from stream start).
   Silero VAD (:mod:`specstream.stages.vad`) labels every 32-ms frame as it arrives.
2. A pass runs when at least ``hop = max(min_hop_s, last pass's wall time)`` of new audio arrived and the
   buffer holds speech (the VAD gates the encoder: silence never reaches Whisper). The whole buffer (<= 30 s)
   becomes one 30-s log-mel window; the encoder and the decoder run in the shared :class:`SpeechService`, as
   ``realtime`` work of the engine's QoS scheduler (the encode is an ``audio`` encode item of the request).
3. The decoder is drafted by the previous hypothesis (temporal drafter, merged with the n-gram drafter):
   the window grew by ~0.5 s, so most tokens are verified rather than generated. Greedy verification keeps
   the output identical to undrafted decoding.
4. **LocalAgreement over a span of audio** commits the longest common prefix of this hypothesis and every
   recent one back to the newest whose window ended ``agree_span_s`` earlier (LocalAgreement-2 when passes are
   that far apart), after the text already committed in the buffer, cut back to a word boundary; when all of
   them are complete and identical (speech ended), all of it is committed.
5. Each window is conditioned on earlier committed text (``<|startofprev|>``). A buffer over ``trim_after_s``
   is trimmed at a VAD pause: the audio up to the pause is decoded once more to split the hypothesis there
   (:meth:`StreamingRecognizer._trim_at_pause`), so no uncommitted audio is dropped; after an utterance, once
   everything is committed and the speaker paused, it is cleared.

Word times: Whisper runs without timestamps here, so a word's end time comes from when it first appeared:
a token first seen in the pass over audio ``[.., hi]`` (and absent at the pass before, over ``[.., lo]``)
ended in ``(lo, hi]``. When ``m`` tokens first appeared in that pass and the word's token is the ``k``-th, it
ended where the VAD's speech frames inside ``(lo, hi]`` reach ``k / m`` of their duration (the end of the last
speech there for the last of them). A final's start is the first VAD speech onset after the previous final's
end. Times are seconds from stream start, clamped to be monotonic and inside the audio received.

Hallucination guards: the VAD gate (and an RMS floor: digital silence and quiet noise are silence); Whisper's
no-speech probability (``<|nocaptions|>`` after ``<|startoftranscript|>``) above ``no_speech_threshold`` empties
the hypothesis; a repetition check (a token pattern repeated ``max_repeats`` times, or a gzip compression ratio
above ``max_compression_ratio``) cuts the hypothesis before the loop and never commits past it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from specstream.modalities.audio import SAMPLE_RATE, log_mel, mel_window
from specstream.stages.vad import FRAME, StreamingVad, VadConfig

WINDOW_S = 30.0  # Whisper's window


# -- the audio ring buffer ----------------------------------------------------------------------------------------
class RingBuffer:
    """16 kHz mono float32 samples of a stream, addressed by absolute sample index from stream start.

    Holds samples ``[start, end)``; :meth:`trim` advances ``start``. The backing array is preallocated
    (``capacity`` samples) and reused circularly; appending more than fits raises ``OverflowError`` (the
    recognizer trims long before).
    """

    def __init__(self, capacity: int):
        self._buf = np.zeros(capacity, dtype=np.float32)
        self.start = 0  # absolute index of the oldest kept sample
        self.end = 0  # absolute index one past the newest sample

    @property
    def capacity(self) -> int:
        return len(self._buf)

    def __len__(self) -> int:
        return self.end - self.start

    def append(self, samples: np.ndarray) -> None:
        n = len(samples)
        if len(self) + n > self.capacity:
            raise OverflowError(f"ring buffer full ({self.capacity} samples)")
        i = self.end % self.capacity
        first = min(n, self.capacity - i)
        self._buf[i:i + first] = samples[:first]
        self._buf[:n - first] = samples[first:]
        self.end += n

    def trim(self, new_start: int) -> None:
        """Drop samples before absolute index ``new_start`` (clamped to ``[start, end]``)."""
        self.start = min(self.end, max(self.start, int(new_start)))

    def view(self, a: int | None = None, b: int | None = None) -> np.ndarray:
        """A copy of samples ``[a, b)`` (absolute; default the whole buffer)."""
        a = self.start if a is None else max(self.start, a)
        b = self.end if b is None else min(self.end, b)
        if b <= a:
            return np.zeros(0, dtype=np.float32)
        i, j = a % self.capacity, b % self.capacity
        if i < j or (b - a) == 0:
            return self._buf[i:j].copy() if i < j else np.zeros(0, dtype=np.float32)
        return np.concatenate([self._buf[i:], self._buf[:j]])


# -- typed results --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Subtitle:
    """One subtitle update.

    Attributes:
        kind: ``"final"`` (committed, sent once) or ``"partial"`` (the uncommitted rest; replaces the last one).
        text: the text ("" for a partial that clears the line).
        start_s, end_s: seconds from stream start.
        emitted_s: the recognizer's clock when it was produced.
        latency_ms: finals only: ``emitted_s`` minus the clock time at which the audio at ``end_s`` arrived.
        tokens: the token ids of the text.
    """

    kind: Literal["partial", "final"]
    text: str
    start_s: float
    end_s: float
    emitted_s: float
    latency_ms: float | None = None
    tokens: tuple[int, ...] = ()

    def message(self) -> dict:
        """The WebSocket message (``docs/streaming.md``)."""
        msg = {"type": self.kind, "text": self.text, "start_s": round(self.start_s, 3), "end_s": round(self.end_s, 3)}
        if self.kind == "final":
            msg["latency_ms"] = round(self.latency_ms or 0.0, 1)
        return msg


@dataclass(frozen=True)
class PassRecord:
    """What one decoding pass did (for benchmarks and the lossless test).

    Attributes:
        audio_start_s, audio_end_s: the window's audio (seconds from stream start).
        tokens: the hypothesis (end-of-text excluded), after the guards.
        raw_tokens: the decoder's output before the guards.
        target_steps: target decoder forwards of the request; drafted: whether a previous hypothesis drafted it.
        encode_s, decode_s, wall_s: encoder batch time, decode time (submit to done, encode excluded), pass time.
        no_speech_prob: Whisper's no-speech probability of the window.
        window: the log-mel window ``[80, 3000]`` (only with ``StreamConfig.keep_windows``).
        prompt: the earlier text the window was conditioned on (``<|startofprev|>`` tokens).
    """

    audio_start_s: float
    audio_end_s: float
    tokens: tuple[int, ...]
    raw_tokens: tuple[int, ...]
    target_steps: int
    drafted: bool
    encode_s: float
    decode_s: float
    wall_s: float
    no_speech_prob: float
    finish_reason: str | None
    window: np.ndarray | None = None
    prompt: tuple[int, ...] = ()


@dataclass(frozen=True)
class StreamConfig:
    """Knobs of :class:`StreamingRecognizer` (seconds unless said otherwise).

    Attributes:
        min_hop_s: least new audio between passes (the hop is ``max(min_hop_s, last pass wall time)``).
        agree_span_s: the commit policy compares the newest hypothesis with every hypothesis back to the newest
            one whose window ended at least this much audio earlier (LocalAgreement-2 when passes are this far
            apart; with faster passes, LocalAgreement-n over this span), so a word is committed only once
            windows this much longer still read it the same way. 0: plain LocalAgreement-2.
        trim_after_s: a buffer longer than this is trimmed at a VAD pause (see :meth:`StreamingRecognizer._trim_at_pause`).
        keep_s: such a trim keeps at least this much audio (the context of the next windows).
        max_buffer_s: a buffer longer than this is trimmed at any VAD pause, or committed and cleared when it has
            none (Whisper sees <= 30 s).
        prompt_chars: about this many characters of earlier committed text condition each window (``<|startofprev|>``).
        max_new_tokens: tokens decoded per window at most.
        no_speech_threshold: above this no-speech probability, the window's hypothesis is dropped.
        max_compression_ratio: gzip ratio of the hypothesis text above which it is treated as a loop.
        max_repeats: a token pattern (1..8 tokens) repeated this many times in a row is a loop.
        utterance_pause_s: after this much silence with everything committed, the buffer is cleared.
        speculate: draft with the previous hypothesis + n-gram (False: one token per decoder step).
        keep_windows: keep each pass's log-mel window in its :class:`PassRecord` (tests).
    """

    min_hop_s: float = 0.5
    agree_span_s: float = 2.5
    trim_after_s: float = 15.0
    keep_s: float = 6.0
    max_buffer_s: float = 25.0
    prompt_chars: int = 200
    max_new_tokens: int = 160
    no_speech_threshold: float = 0.6
    max_compression_ratio: float = 2.4
    max_repeats: int = 4
    utterance_pause_s: float = 0.6
    speculate: bool = True
    keep_windows: bool = False
    vad: VadConfig = field(default_factory=VadConfig)

    def __post_init__(self):
        if not self.min_hop_s > 0:
            raise ValueError(f"min_hop_s must be > 0, got {self.min_hop_s}")
        if not self.agree_span_s >= 0:
            raise ValueError(f"agree_span_s must be >= 0, got {self.agree_span_s}")


@dataclass(frozen=True)
class WindowDecode:
    """A decoded window from :class:`SpeechService`."""

    tokens: tuple[int, ...]
    finish_reason: str | None
    target_steps: int
    no_speech_prob: float
    encode_s: float
    decode_s: float


# -- the shared model and engine ------------------------------------------------------------------------------
class SpeechService:
    """One Whisper model and one speculative engine (QoS scheduler) shared by every stream of the process.

    Each window is one ``realtime`` request whose ``audio`` encode item the scheduler batches with other
    streams' windows; the executor's encoder hook runs the Hugging Face encoder on the batch, projects the
    encoder outputs into cross-attention keys/values once (``CrossKV`` of
    :mod:`specstream.stages.speculative.models.whisper`, copied by the prefill and by the no-speech probe) and
    computes the no-speech probability. An :class:`EngineDriver` steps the engine in a
    worker thread, so the event loop stays free.

    Args:
        model: a loaded :class:`~specstream.stages.speech.SpeechModel` (default: tiny.en).
        num_slots: concurrent windows in the engine (one per active stream is enough).
        metrics: :class:`~specstream.schedulers.metrics.SchedulerMetrics` to update, or None.
    """

    def __init__(self, model=None, num_slots: int = 16, metrics=None, max_encode_batch: int = 8):
        from specstream.schedulers.qos import EncodeBatching, QosConfig, QosScheduler
        from specstream.stages.speculative.drafters.ngram import NgramDrafter
        from specstream.stages.speculative.drafters.temporal import TemporalDrafter
        from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
        from specstream.stages.speech import SpeechModel

        self.model = model if model is not None else SpeechModel.load()
        sm = self.model
        self.temporal = TemporalDrafter()
        drafters = [self.temporal, NgramDrafter(max_ngram=3, max_branches=2, max_depth=8)]
        max_len = sm.max_target_positions
        full = 17
        qos = QosConfig(num_slots=num_slots, max_len=max_len, reserved_realtime_slots=0,
                        token_budget=max(1024, num_slots * (full + 1)), max_nodes_per_request=full,
                        max_tree_depth=16, preempt=False,
                        max_queue={"realtime": 4 * num_slots, "interactive": 256, "batch": 4096},
                        encoders={"audio": EncodeBatching(max_encode_batch, 0.0)})
        scheduler = QosScheduler(qos, metrics=metrics)
        self.engine = SpeculativeEngine(sm.decoder, drafters, EngineConfig(num_slots=num_slots, max_len=max_len,
                                                                           max_nodes_per_request=full),
                                        (sm.tokens.eot,), sm.tokenizer, scheduler=scheduler)
        self.engine.executor.encoders["audio"] = self._encode
        self._windows: dict[str, np.ndarray] = {}  # encode item id -> log-mel window
        self._encoded: dict[str, tuple[float, float]] = {}  # request id -> (no-speech prob, encode seconds)
        self._ids = itertools.count()
        self._word_start: dict[int, bool] = {}
        self.driver = None
        self.encode_batches: list[tuple[int, float]] = []  # (batch size, seconds)

    async def start(self) -> None:
        from specstream.stages.decode import EngineDriver

        if self.driver is None:
            self.driver = EngineDriver(self.engine)
            self.driver.start()

    async def stop(self) -> None:
        if self.driver is not None:
            await self.driver.stop()
            self.driver = None

    def _encode(self, work) -> None:
        """Executor encoder hook (worker thread): one encoder batch for the work's audio windows."""
        t0 = time.perf_counter()
        items = [(rid, self._windows.pop(item.item_id)) for rid, item in work.items]
        enc = self.model.encode(np.stack([w for _, w in items]))
        kvs = self.model.decoder.project(enc)  # once: the prefill and the no-speech probe copy them
        ex = self.engine.executor
        for (rid, _), kv in zip(items, kvs):
            ex.encoder_outputs[rid] = kv
        probs = [self.model.no_speech_prob(kv) for kv in kvs]
        dt = time.perf_counter() - t0
        self.encode_batches.append((len(items), dt))
        for (rid, _), p in zip(items, probs):
            self._encoded[rid] = (p, dt)

    async def decode_window(self, window: np.ndarray, hypothesis: Sequence[int] | None = None,
                            speculate: bool = True, max_new_tokens: int = 160,
                            seconds: float = 30.0, previous_text: Sequence[int] = ()) -> WindowDecode:
        """Encode and greedy-decode one log-mel window ``[80, 3000]`` as ``realtime`` work.

        Args:
            hypothesis: the previous hypothesis of this stream (drafts; None for none).
            seconds: audio seconds in the window (the cost model's encode units).
            previous_text: token ids of text said before the window (committed earlier): the prompt becomes
                ``<|startofprev|> previous_text <|startoftranscript|> ...`` (whisper_streaming's context).

        Raises:
            CapacityError: the realtime queue is full; SpecstreamError: decoding failed.
        """
        from specstream.errors import SpecstreamError
        from specstream.schedulers.plan import EncodeItem

        if self.driver is None:
            await self.start()
        sm = self.model
        prompt = sm.prompt()
        if previous_text and sm.tokens.sot_prev is not None:
            prompt = [sm.tokens.sot_prev, *previous_text] + prompt
        rid = f"win-{next(self._ids)}"
        item = EncodeItem(f"{rid}/audio", "audio", float(seconds))
        req = self.engine.make_request(prompt, min(max_new_tokens, sm.max_target_positions - len(prompt)),
                                       request_id=rid, speculate=speculate, qos="realtime", encodes=(item,),
                                       logits_processors=sm.logits_processors(len(prompt)),
                                       draft_hypothesis=tuple(hypothesis) if hypothesis and speculate else None)
        self._windows[item.item_id] = window
        t0 = time.perf_counter()
        try:
            done = await self.driver.submit(req)
        finally:
            self._windows.pop(item.item_id, None)
        wall = time.perf_counter() - t0
        nsp, enc_s = self._encoded.pop(rid, (0.0, 0.0))
        if done.error:
            raise SpecstreamError(f"decoding failed: {done.error}")
        toks = tuple(t for t in done.output_ids if t != sm.tokens.eot)
        return WindowDecode(toks, done.finish_reason, done.stats.target_steps, nsp, enc_s, max(0.0, wall - enc_s))

    # -- token helpers --------------------------------------------------------------------------------------
    def starts_word(self, token: int) -> bool:
        """True when ``token``'s text begins with a space (a new word)."""
        v = self._word_start.get(token)
        if v is None:
            piece = self.model.tokenizer.id_to_token(token) or ""
            v = piece.startswith("\u0120") or piece.startswith(" ")
            self._word_start[token] = v
        return v

    def text(self, tokens: Sequence[int]) -> str:
        return self.model.decode_text(tokens)


# -- guards ---------------------------------------------------------------------------------------------------
def repetition_cut(tokens: Sequence[int], max_repeats: int, max_period: int = 8) -> int | None:
    """Index where a loop begins (a pattern of 1..``max_period`` tokens repeated ``max_repeats`` times in a row,
    cut after its first occurrence), or None."""
    n = len(tokens)
    for i in range(n):
        for p in range(1, max_period + 1):
            if i + p * max_repeats > n:
                break
            pat = tokens[i:i + p]
            if all(tokens[i + k * p:i + (k + 1) * p] == pat for k in range(1, max_repeats)):
                return i + p
    return None


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / max(1, len(zlib.compress(data))) if data else 0.0


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _carry_seen(prev: Sequence[int], prev_seen: Sequence[tuple[float, float]], hyp: Sequence[int],
                now: tuple[float, float]) -> list[tuple[float, float]]:
    """First-seen intervals of ``hyp``'s tokens: tokens matched (difflib) to the previous hypothesis keep their
    interval; new ones get ``now`` (the previous pass's audio end, this pass's audio end)."""
    import difflib

    seen = [now] * len(hyp)
    if prev:
        for b in difflib.SequenceMatcher(None, list(prev), list(hyp), autojunk=False).get_matching_blocks():
            for k in range(b.size):
                seen[b.b + k] = prev_seen[b.a + k]
    for i in range(1, len(seen)):  # times never decrease along the text
        seen[i] = (max(seen[i][0], seen[i - 1][0]), max(seen[i][1], seen[i - 1][1]))
    return seen


# -- the recognizer ---------------------------------------------------------------------------------------------
class StreamingRecognizer:
    """Live subtitles of one audio stream (see the module docstring).

    Args:
        service: the shared :class:`SpeechService`.
        config: :class:`StreamConfig`.
        clock: seconds, monotonic; ``time.monotonic`` live, a :class:`SimClock` when replaying a file.
    """

    def __init__(self, service: SpeechService, config: StreamConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.service = service
        self.config = config or StreamConfig()
        self.clock = clock
        self.vad = StreamingVad(self.config.vad)
        # room for a minute of backlog when passes fall behind: audio is never dropped to make room
        self.buffer = RingBuffer(int(max(60.0, self.config.max_buffer_s + 30.0) * SAMPLE_RATE))
        self._history: list[int] = []  # committed tokens already trimmed from the buffer (the prompt)
        self._arrivals: list[tuple[int, float]] = []  # (absolute sample end, clock at arrival)
        self._committed: list[int] = []  # tokens committed since the buffer start
        self._prev: list[int] | None = None  # previous hypothesis of the current buffer
        self._prev_complete = False
        self._seen: list[tuple[float, float]] = []  # per token of _prev: (lo, hi) first-seen interval
        # recent hypotheses of the current buffer, oldest first: (window end s, tokens, complete); the last is _prev
        self._hyps: list[tuple[float, list[int], bool]] = []
        self._last_pass_end_s = 0.0
        self._hop_s = self.config.min_hop_s
        self._last_end_s = 0.0  # end of the last final
        self._partial = ""
        self.passes: list[PassRecord] = []
        self.finals: list[Subtitle] = []
        self.finished = False

    # -- the contract -----------------------------------------------------------------------------------------
    @property
    def audio_end_s(self) -> float:
        return self.buffer.end / SAMPLE_RATE

    @property
    def backlog_s(self) -> float:
        """Seconds of received audio that no pass has decoded yet (grows without bound when RTF > 1)."""
        return self.audio_end_s - self._last_pass_end_s

    def insert_audio(self, samples: np.ndarray, arrived_at: float | None = None) -> None:
        """Append 16 kHz mono float32 ``samples`` ``[n]``; the VAD labels them at once.

        ``arrived_at``: the clock time the samples arrived (default: now); finals' ``latency_ms`` count from
        it (a benchmark passes the scheduled arrival, so time spent before the insert counts too).

        Raises:
            RuntimeError: after :meth:`finish`.
        """
        if self.finished:
            raise RuntimeError("stream finished")
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        if not len(x):
            return
        if len(self.buffer) + len(x) > self.buffer.capacity:
            self._force_trim(len(self.buffer) + len(x) - self.buffer.capacity)
        self.buffer.append(x)
        self._arrivals.append((self.buffer.end, self.clock() if arrived_at is None else float(arrived_at)))
        self.vad.accept(x)

    def ready(self) -> bool:
        """A pass is due: ``hop`` seconds of new audio since the last pass."""
        return self.audio_end_s - self._last_pass_end_s >= self._hop_s - 1e-9

    async def process(self) -> list[Subtitle]:
        """One pass over the buffer (when :meth:`ready`; a no-op otherwise). Returns new subtitles."""
        if not self.ready() or self.finished:
            return []
        return await self._pass(final=False)

    async def finish(self) -> list[Subtitle]:
        """End of stream: decode what is left and commit all of it. Returns the last subtitles."""
        if self.finished:
            return []
        out: list[Subtitle] = []
        while len(self.buffer) > int(WINDOW_S * SAMPLE_RATE):  # a backlog longer than one window
            before = self.buffer.start
            out.extend(await self._trim_at_pause(self.buffer.start / SAMPLE_RATE + WINDOW_S, force=True))
            if self.buffer.start == before:
                break
        out.extend(await self._pass(final=True))
        self.finished = True
        return out

    # -- a pass ------------------------------------------------------------------------------------------------
    async def _pass(self, final: bool) -> list[Subtitle]:
        t0 = time.perf_counter()
        cfg = self.config
        out: list[Subtitle] = []
        lo_s = self._last_pass_end_s
        if len(self.buffer) > int(cfg.trim_after_s * SAMPLE_RATE) and self._prev is not None:
            out.extend(await self._trim_at_pause(min(lo_s, self.audio_end_s - cfg.keep_s)))
        if len(self.buffer) > int(cfg.max_buffer_s * SAMPLE_RATE):
            out.extend(await self._trim_at_pause(self.audio_end_s - 1.0, force=True))
        # a pass sees at most one 30-s window; when passes fell behind, the rest waits for the next pass
        end = min(self.buffer.end, self.buffer.start + int(WINDOW_S * SAMPLE_RATE))
        end_s = end / SAMPLE_RATE
        start_s = self.buffer.start / SAMPLE_RATE
        self._last_pass_end_s = end_s
        # the VAD gate: no speech in the buffer -> no encoder, nothing to say
        if not self.vad.has_speech(start_s, end_s):
            if self._partial:
                out.append(self._emit_partial(""))
            self._reset_buffer(max(self.buffer.start, end - SAMPLE_RATE // 2))
            self._hop_s = cfg.min_hop_s
            return out
        pending = self._prev is not None and len(self._prev) > len(self._committed)
        if not final and not pending and self._prev is not None \
                and not self.vad.has_speech(lo_s, end_s):
            # nothing new was said and nothing waits for agreement
            self._maybe_end_utterance(end_s)
            self._hop_s = cfg.min_hop_s
            return out
        hyp, complete = await self._decode(self.buffer.start, end)
        out.extend(self._agree(hyp, complete, lo_s, end_s, final))
        wall = time.perf_counter() - t0
        last = self.passes[-1]
        self.passes[-1] = PassRecord(**{**last.__dict__, "wall_s": wall})
        self._hop_s = max(cfg.min_hop_s, wall)
        if not final:
            self._maybe_end_utterance(end_s)
        return out

    async def _decode(self, a: int, b: int) -> tuple[list[int], bool]:
        """Decode the buffer's samples ``[a, b)`` (conditioned on the earlier committed text, drafted by the
        previous hypothesis); records a :class:`PassRecord`. Returns the guarded hypothesis, complete."""
        cfg = self.config
        audio = self.buffer.view(a, b)
        window, _ = mel_window(log_mel(audio, self.service.model.num_mel_bins), 0)
        prompt = self._prompt_tokens()
        dec = await self.service.decode_window(window, self._prev if cfg.speculate else None,
                                               speculate=cfg.speculate, max_new_tokens=cfg.max_new_tokens,
                                               seconds=len(audio) / SAMPLE_RATE, previous_text=prompt)
        hyp, complete = self._guard(dec)
        self.passes.append(PassRecord(a / SAMPLE_RATE, b / SAMPLE_RATE, tuple(hyp), dec.tokens, dec.target_steps,
                                      bool(self._prev) and cfg.speculate, dec.encode_s, dec.decode_s,
                                      0.0, dec.no_speech_prob, dec.finish_reason,
                                      window if cfg.keep_windows else None, tuple(prompt)))
        return hyp, complete

    def _prompt_tokens(self) -> list[int]:
        """The last ~``prompt_chars`` characters of committed text that left the buffer, whole words."""
        h = self._history[-max(8, self.config.prompt_chars // 2):]
        i = 0
        while i < len(h) and (not self.service.starts_word(h[i])
                              or len(self.service.text(h[i:])) > self.config.prompt_chars):
            i += 1
        return h[i:]

    def _guard(self, dec: WindowDecode) -> tuple[list[int], bool]:
        """(hypothesis after the hallucination guards, whether it is complete and trustworthy)."""
        cfg = self.config
        toks = list(dec.tokens)
        complete = dec.finish_reason == "eos"
        if dec.no_speech_prob > cfg.no_speech_threshold:
            return [], True
        cut = repetition_cut(toks, cfg.max_repeats)
        if cut is not None:
            toks, complete = toks[:cut], False
        if compression_ratio(self.service.text(toks)) > cfg.max_compression_ratio:
            return [], False
        return toks, complete

    def _align(self, hyp: list[int]) -> int | None:
        """Index in ``hyp`` just after the text already committed in this buffer, or None when it cannot be
        aligned. Whisper may re-spell committed words in a longer window ("roundfark" -> "round fox"): the
        committed tokens are matched to ``hyp`` (difflib), and the end of the last match near the committed
        end is carried to the next word boundary of ``hyp``."""
        import difflib

        c = self._committed
        if not c:
            return 0
        if hyp[:len(c)] == c:
            return len(c)
        blocks = [b for b in difflib.SequenceMatcher(None, c, hyp, autojunk=False).get_matching_blocks() if b.size]
        if not blocks:
            return None
        last = blocks[-1]
        a_end, b_end = last.a + last.size, last.b + last.size
        if len(c) - a_end > 4:  # the committed text's end is nowhere in hyp
            return None
        j = min(len(hyp), b_end + (len(c) - a_end))
        while j < len(hyp) and not self.service.starts_word(hyp[j]):
            j += 1
        return j

    def _agree(self, hyp: list[int], complete: bool, lo_s: float, end_s: float, final: bool) -> list[Subtitle]:
        """The commit policy; returns the final and/or partial.

        LocalAgreement over a span of audio: ``hyp`` is compared with every recent hypothesis back to the newest
        one whose window ended at least ``agree_span_s`` earlier (with passes that far apart: the previous one,
        i.e. LocalAgreement-2). The longest prefix (after the committed text) all of them agree on is committed,
        cut back to a word boundary; when all of them are complete and identical (speech ended), all of it.
        With 0.5-s hops plain LocalAgreement-2 committed tiny.en's first readings of a sentence, which windows
        a second or two longer correct."""
        out: list[Subtitle] = []
        prev, prev_seen = self._prev, self._seen
        seen = _carry_seen(prev or [], prev_seen, hyp, (lo_s, end_s))
        a = self._align(hyp)
        commit_to = None  # index in hyp up to which the text is committed
        if a is not None:
            if final:
                commit_to = len(hyp)
            else:
                refs = self._agreement_refs(end_s)
                aligned = [(h, self._align(h), c) for h, c in refs]
                if refs and all(pa is not None for _, pa, _ in aligned):
                    new = hyp[a:]
                    agree = min(_lcp(new, h[pa:]) for h, pa, _ in aligned)
                    if complete and all(c and agree == len(new) == len(h) - pa for h, pa, c in aligned):
                        commit_to = len(hyp)
                    else:
                        j = agree  # back to a word start (the last word may still grow)
                        while j > 0 and not (j < len(new) and self.service.starts_word(new[j])):
                            j -= 1
                        commit_to = a + j
            if commit_to is not None and commit_to > a:
                out.append(self._emit_final(hyp[a:commit_to], seen[a:commit_to], end_s, seen[commit_to:]))
                self._committed = list(hyp[:commit_to])
            elif commit_to is None:
                commit_to = a
        self._prev, self._seen, self._prev_complete = list(hyp), seen, complete
        self._remember(end_s, hyp, complete)
        rest = hyp[commit_to:] if commit_to is not None else []
        text = self.service.text(rest) if rest else ""
        if text != self._partial:
            out.append(self._emit_partial(text))
        return out

    def _agreement_refs(self, end_s: float) -> list[tuple[list[int], bool]]:
        """The hypotheses a new one at ``end_s`` must agree with: all from the newest one whose window ended at
        least ``agree_span_s`` before ``end_s`` on (empty: none is old enough, nothing is committed yet)."""
        span = self.config.agree_span_s
        old = [i for i, (e, _, _) in enumerate(self._hyps) if e <= end_s - span + 1e-6]
        if not old:
            return []
        return [(h, c) for _, h, c in self._hyps[old[-1]:]]

    def _remember(self, end_s: float, hyp: list[int], complete: bool) -> None:
        """Append a hypothesis to the recent ones; drop those no later pass compares with."""
        self._hyps.append((end_s, list(hyp), complete))
        span = self.config.agree_span_s
        old = [i for i, (e, _, _) in enumerate(self._hyps) if e <= end_s - span + 1e-6]
        if old:
            del self._hyps[:old[-1]]

    # -- emitting ------------------------------------------------------------------------------------------------
    def _emit_final(self, tokens: list[int], seen: list[tuple[float, float]], end_s: float,
                    rest_seen: Sequence[tuple[float, float]] = ()) -> Subtitle:
        """A final for ``tokens`` (first-seen intervals ``seen``); ``rest_seen``: the intervals of the hypothesis
        tokens after it (not committed).

        The end time: the last token first appeared in a pass over ``(lo, hi]``, together with ``k`` - 1 tokens
        before it in this final and ``m`` - ``k`` after it. Words take speech time, so it ended where the
        speech inside ``(lo, hi]`` (VAD frames) reaches the fraction ``k / m``: the end of the last speech
        there when nothing after it was first seen in that pass. (Taking the first VAD pause in the interval put
        the end of a whole utterance decoded in one pass at its first pause.)"""
        lo, hi = seen[-1]
        k = sum(1 for x in seen if x == (lo, hi))
        m = k + sum(1 for x in rest_seen if x == (lo, hi))
        t_end = self._speech_time_at(lo, hi, k / m)
        onset = self._speech_onset(self._last_end_s, end_s)
        start = max(self._last_end_s, onset if onset is not None else self._last_end_s)
        t_end = max(start, min(end_s, t_end))  # monotonic first (ends are coarse upper bounds)
        now = self.clock()
        sub = Subtitle("final", self.service.text(tokens), round(start, 3), round(t_end, 3), now,
                       (now - self._arrival_clock(t_end)) * 1000.0, tuple(tokens))
        self._last_end_s = t_end
        self.finals.append(sub)
        self._partial = ""
        return sub

    def _emit_partial(self, text: str) -> Subtitle:
        self._partial = text
        end = self.audio_end_s
        return Subtitle("partial", text, round(self._last_end_s, 3), round(max(self._last_end_s, end), 3),
                        self.clock())

    def _arrival_clock(self, t_s: float) -> float:
        """Clock time at which the audio at ``t_s`` had arrived."""
        sample = int(round(t_s * SAMPLE_RATE))
        for s_end, at in self._arrivals:
            if s_end >= sample:
                return at
        return self._arrivals[-1][1] if self._arrivals else self.clock()

    def _speech_time_at(self, lo_s: float, hi_s: float, fraction: float) -> float:
        """Where the VAD's speech frames inside ``(lo_s, hi_s]`` reach ``fraction`` of their total duration (the
        end of that frame); ``hi_s`` when the interval holds no speech."""
        fa = max(0, int(lo_s * SAMPLE_RATE) // FRAME)
        fb = min(self.vad.frames, -(-int(hi_s * SAMPLE_RATE) // FRAME))
        frames = [i for i in range(fa, fb) if self.vad.speech[i]]
        if not frames:
            return hi_s
        j = min(len(frames) - 1, max(0, int(np.ceil(fraction * len(frames))) - 1))
        return min(hi_s, max(lo_s, (frames[j] + 1) * FRAME / SAMPLE_RATE))

    def _speech_onset(self, a_s: float, b_s: float) -> float | None:
        fa = int(a_s * SAMPLE_RATE) // FRAME
        fb = min(self.vad.frames, int(b_s * SAMPLE_RATE) // FRAME + 1)
        for i in range(max(0, fa), fb):
            if self.vad.speech[i]:
                return max(a_s, i * FRAME / SAMPLE_RATE)
        return None

    # -- trimming ------------------------------------------------------------------------------------------------
    def _reset_buffer(self, new_start: int) -> None:
        self._history += self._committed
        self.buffer.trim(new_start)
        self._committed, self._prev, self._seen, self._prev_complete = [], None, [], False
        self._hyps = []
        self._drop_old_arrivals()

    def _drop_old_arrivals(self) -> None:
        keep = max(0, self.buffer.start - 60 * SAMPLE_RATE)
        while len(self._arrivals) > 1 and self._arrivals[0][0] < keep:
            self._arrivals.pop(0)

    def _maybe_end_utterance(self, end_s: float) -> None:
        """Everything committed and the speaker paused: clear the buffer up to the end of speech."""
        if self._prev is None or len(self._prev) > len(self._committed):
            return
        last = self.vad.last_speech_end_s()
        if last is not None and end_s - last >= self.config.utterance_pause_s and last > self.buffer.start / SAMPLE_RATE:
            self._reset_buffer(int(last * SAMPLE_RATE))

    async def _trim_at_pause(self, limit_s: float, force: bool = False) -> list[Subtitle]:
        """Trim the buffer at the latest VAD pause before ``limit_s`` (whisper_streaming trims at committed
        segment ends; without timestamps, a pause is where the text can be split safely).

        The audio up to the pause ``p`` is decoded once more on its own: that hypothesis (drafted by the
        previous one, so mostly verified) is located in the previous hypothesis of the whole buffer, which
        splits it into the text before ``p`` and after. Text before ``p`` not committed yet is committed now
        (a final) - it was decoded with the most context this buffer had. The text before ``p`` moves to the
        prompt history, the rest stays committed / pending in the new buffer ``[p, ..)``: no audio is dropped
        and nothing is committed twice. Without a pause (``force``): everything is committed and the buffer
        restarts at its end."""
        cfg = self.config
        out: list[Subtitle] = []
        if self._prev is None:
            return out
        start_s = self.buffer.start / SAMPLE_RATE
        limit_s = min(limit_s, self._last_pass_end_s)  # the previous hypothesis covers the audio up to here
        half = cfg.vad.min_silence_s / 2
        cuts = [t + half for t in self.vad.speech_offsets(start_s + 0.5, limit_s) if t + half <= limit_s]
        k = None
        part: list[int] = []
        if cuts:
            p = cuts[-1]
            part, _ = await self._decode(self.buffer.start, int(round(p * SAMPLE_RATE)))
            k = self._locate(self._prev, part)
        if k is None:
            if not force:
                return out
            p, k = self._last_pass_end_s, len(self._prev)  # the previous pass covered the buffer to here
            self._hyps = []
        else:  # the recent hypotheses lose the same text (those where it cannot be located are dropped)
            hyps = []
            for e, h, c in self._hyps[:-1]:
                kh = self._locate(h, part)
                if kh is not None:
                    hyps.append((e, h[kh:], c))
            self._hyps = hyps + [(e, h[k:], c) for e, h, c in self._hyps[-1:]] if len(self._prev) > k else []
        c = len(self._committed)
        if k > c:
            out.append(self._emit_final(self._prev[c:k], self._seen[c:k], p, self._seen[k:]))
        self._history += self._prev[:k]
        self._committed = self._committed[k:]
        self._prev, self._seen = (self._prev[k:], self._seen[k:]) if len(self._prev) > k else (None, [])
        self.buffer.trim(int(round(p * SAMPLE_RATE)))
        self._drop_old_arrivals()
        return out

    def _locate(self, seq: list[int], part: list[int]) -> int | None:
        """Index in ``seq`` where ``part`` (a reading of the start of the same audio) ends, at a word start of
        ``seq``; None when ``part``'s end is nowhere in ``seq``."""
        import difflib

        if not part:
            return 0
        if seq[:len(part)] == part:
            j = len(part)
        else:
            blocks = [b for b in difflib.SequenceMatcher(None, part, seq, autojunk=False).get_matching_blocks()
                      if b.size]
            if not blocks or len(part) - (blocks[-1].a + blocks[-1].size) > 3:
                return None
            j = blocks[-1].b + blocks[-1].size
        while j < len(seq) and not self.service.starts_word(seq[j]):
            j += 1
        return j

    def _force_trim(self, need: int) -> None:
        """The buffer is full: drop the oldest audio, committed first (the hypothesis restarts)."""
        cut = self.buffer.start + max(need, int(self.config.max_buffer_s * SAMPLE_RATE) // 2)
        if self.finals:
            cut = max(cut, int(self.finals[-1].end_s * SAMPLE_RATE))
        self._reset_buffer(cut)


# -- replay on a simulated clock --------------------------------------------------------------------------------------
class SimClock:
    """A clock for replays: ``now()`` is the simulated time, plus the real compute time of a running pass."""

    def __init__(self):
        self.t = 0.0
        self._mark: float | None = None

    def __call__(self) -> float:
        return self.t + (time.perf_counter() - self._mark if self._mark is not None else 0.0)

    def begin(self) -> None:
        self._mark = time.perf_counter()

    def end(self) -> None:
        self.t = self()
        self._mark = None


@dataclass
class ReplayResult:
    subtitles: list[Subtitle]
    passes: list[PassRecord]
    duration_s: float
    wall_s: float

    @property
    def finals(self) -> list[Subtitle]:
        return [s for s in self.subtitles if s.kind == "final"]

    @property
    def text(self) -> str:
        return " ".join(s.text for s in self.finals if s.text)


async def replay(service: SpeechService, audio: np.ndarray, chunk_s: float = 0.5,
                 config: StreamConfig | None = None) -> ReplayResult:
    """Stream ``audio`` (16 kHz float32) through a recognizer on a simulated clock: chunk ``k`` arrives at
    ``(k + 1) * chunk_s``; passes take their real compute time on that clock; idle waits take none. So the
    latencies are those of a live stream on this machine (one stream, no other load), faster than real time."""
    clock = SimClock()
    rec = StreamingRecognizer(service, config, clock=clock)
    step = int(round(chunk_s * SAMPLE_RATE))
    chunks = [audio[i:i + step] for i in range(0, len(audio), step)]
    arrivals = [min(len(audio), (k + 1) * step) / SAMPLE_RATE for k in range(len(chunks))]
    subs: list[Subtitle] = []
    t_wall = time.perf_counter()
    k = 0
    while k < len(chunks):
        while k < len(chunks) and arrivals[k] <= clock.t + 1e-9:
            rec.insert_audio(chunks[k])
            k += 1
        if rec.ready():
            clock.begin()
            subs.extend(await rec.process())
            clock.end()
        elif k < len(chunks):
            clock.t = max(clock.t, arrivals[k])
    clock.begin()
    subs.extend(await rec.finish())
    clock.end()
    return ReplayResult(subs, rec.passes, len(audio) / SAMPLE_RATE, time.perf_counter() - t_wall)


def replay_file(path: str, model=None, chunk_s: float = 0.5, config: StreamConfig | None = None) -> ReplayResult:
    """:func:`replay` of an audio file with a fresh :class:`SpeechService` (blocking)."""
    from specstream.modalities.audio import load_audio

    async def run():
        svc = SpeechService(model, num_slots=2)
        try:
            return await replay(svc, load_audio(path), chunk_s, config)
        finally:
            await svc.stop()

    return asyncio.run(run())
