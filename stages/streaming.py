"""Streaming speech recognition: live subtitles from audio chunks (whisper_streaming's online processor, with
Whisper's decoder in the speculative engine and Whisper's timestamp tokens for segments).

One contract for every driver (a WebSocket session, a file replayed on a simulated clock, a benchmark):
:meth:`StreamingRecognizer.insert_audio` (16 kHz mono float32, any chunk size), :meth:`~StreamingRecognizer.process`
(one decoding pass when :meth:`~StreamingRecognizer.ready`) and :meth:`~StreamingRecognizer.finish`; each returns
typed :class:`Subtitle` s. Only committed text leaves the stage as ``final``, once; the rest is ``partial``.

Guarantees (tested):

- **No lost audio.** Every sample that arrives is kept until a pass decoded it (the buffer grows as needed; the
  server bounds it by backpressure, ``StreamConfig.max_backlog_s``); passes run in order whatever the backlog.
  Audio leaves the buffer only when its text was committed, or when the VAD heard no speech in it, or when
  Whisper's silence rule (no-speech probability > 0.6 **and** average log-probability < -1, faster-whisper's
  rule) judged a whole ``max_buffer_s`` buffer silent.
- **Passes at hop positions.** Pass ``k`` decodes the buffer up to ``k * hop_s`` of audio (and the last one up to
  the end of the stream), using only audio before that position (VAD frames included). By default every position
  gets its pass, so the finals depend on the audio, not on how fast it arrived or how long passes took; drafts
  never change them (greedy verification is lossless). With ``catch_up_s`` set, a pass that would start more than
  that behind its audio moves to the newest position that has arrived (skipping positions, never audio), so a
  slow machine's finals stay nearer the clock.
- **Commit at a bound.** Complete segments are committed when the hypotheses of the last ``agree_span_s`` of audio
  agree on them (LocalAgreement; with ``agree_span_s=0`` the previous hypothesis only: LocalAgreement-2), and in
  any case: when no final was sent for ``max_final_gap_s`` of audio, what the last two hypotheses agree on (whole
  segments; at span 0 whole words too); when the buffer reaches ``max_buffer_s``, every complete segment (or,
  without one, everything); at the end of the stream, everything. Uncommitted text is never discarded; speech that
  Whisper left unread after its last segment is read again from there.

How a pass works:

1. The audio lives in a :class:`RingBuffer` (absolute sample positions from stream start); Silero VAD
   (:mod:`specstream.stages.vad`) labels every 32-ms frame as it arrives.
2. The buffer ``[start, P)`` becomes one 30-s log-mel window (faster-whisper's feature-space padding), prompted
   with earlier committed text (``<|startofprev|>``, whisper_streaming's context). The encoder and decoder run in
   the shared :class:`SpeechService` as ``realtime`` work of the engine's QoS scheduler; Whisper writes timestamp
   tokens (:class:`~specstream.stages.whisper_timing.ApplyTimestampRules`), so the hypothesis is a list of segments
   with start and end times.
3. The decoder is drafted by the previous hypothesis (temporal drafter, merged with the n-gram drafter).
4. The commit policy above; a final's times come from the segments' timestamps, tightened to the VAD's speech
   inside them (a final that ends inside a segment gets a time shared out in proportion to the characters; times
   are clamped monotonic). One final per segment.
5. When the buffer is longer than ``trim_after_s`` (keeping ``keep_s``), or the speaker paused with everything
   committed, or Whisper stopped before the end of the speech, it is cut at the end of a committed segment (moved
   into the nearest VAD pause); that text moves to the prompt history.

Hallucination guards: the VAD gate (and an RMS floor: digital silence and quiet noise are silence); the silence
rule; a repetition check (a token pattern repeated ``max_repeats`` times, or a gzip compression ratio above
``max_compression_ratio``) cuts the hypothesis before the loop.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from specstream.modalities.audio import SAMPLE_RATE, log_mel, mel_window
from specstream.stages.vad import FRAME, StreamingVad, VadConfig

WINDOW_S = 30.0  # Whisper's window


# -- the audio ring buffer ----------------------------------------------------------------------------------------
class RingBuffer:
    """16 kHz mono float32 samples of a stream, addressed by absolute sample index from stream start.

    Holds samples ``[start, end)``; :meth:`trim` advances ``start``. The backing array is preallocated and reused
    circularly; when an append does not fit, it grows (doubles): audio is never dropped to make room.
    """

    def __init__(self, capacity: int):
        self._buf = np.zeros(max(1, capacity), dtype=np.float32)
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
            kept = self.view()
            cap = self.capacity
            while cap < len(kept) + n:
                cap *= 2
            self._buf = np.zeros(cap, dtype=np.float32)
            i = self.start % cap
            first = min(len(kept), cap - i)
            self._buf[i:i + first] = kept[:first]
            self._buf[:len(kept) - first] = kept[first:]
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
        if i < j:
            return self._buf[i:j].copy()
        return np.concatenate([self._buf[i:], self._buf[:j]])


# -- typed results --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Subtitle:
    """One subtitle update.

    Attributes:
        kind: ``"final"`` (committed, sent once) or ``"partial"`` (the uncommitted rest; replaces the last one).
        text: the text ("" for a partial that clears the line).
        start_s, end_s: seconds from stream start (finals: from Whisper's timestamp tokens).
        emitted_s: the recognizer's clock when it was produced.
        latency_ms: finals only: ``emitted_s`` minus the clock time at which the audio at ``end_s`` arrived.
        tokens: the token ids of the text.
        position_s: finals only: the audio position of the pass that committed it (``position_s - end_s`` is the
            latency in audio, whatever the machine's speed).
    """

    kind: Literal["partial", "final"]
    text: str
    start_s: float
    end_s: float
    emitted_s: float
    latency_ms: float | None = None
    tokens: tuple[int, ...] = ()
    position_s: float | None = None

    def message(self) -> dict:
        """The WebSocket message (``docs/streaming.md``)."""
        msg = {"type": self.kind, "text": self.text, "start_s": round(self.start_s, 3), "end_s": round(self.end_s, 3)}
        if self.kind == "final":
            msg["latency_ms"] = round(self.latency_ms or 0.0, 1)
        return msg


@dataclass(frozen=True)
class StreamWarning:
    """The stream cannot keep up: its passes take longer than the audio between them (``rtf > 1``), so its finals
    fall further behind the clock with every pass, or with ``StreamConfig.catch_up_s`` set its passes skip hop
    positions to stay nearer the clock (nothing is lost either way: the backlog grows, then backpressure).
    Sent once per stream: on its first pass when earlier streams of the same service measured it, else as soon as
    this stream measured it (:data:`RTF_PASSES` decoding passes).

    Attributes:
        code: ``"falling_behind"``.
        text: what happened and what helps.
        rtf: measured real-time factor, seconds of pass compute per second of audio (``pass_s / hop_s``).
        pass_s: mean seconds per decoding pass (the recognizer's clock: device-loop waits included).
        hop_s: audio between passes (s).
        emitted_s: the recognizer's clock when it was produced.
    """

    code: str
    text: str
    rtf: float
    pass_s: float
    hop_s: float
    emitted_s: float
    kind: Literal["warning"] = "warning"

    def message(self) -> dict:
        """The WebSocket message (``docs/streaming.md``)."""
        return {"type": "warning", "code": self.code, "message": self.text, "rtf": round(self.rtf, 3),
                "pass_s": round(self.pass_s, 3), "hop_s": round(self.hop_s, 3)}


#: decoding passes a stream measures before it judges its own real-time factor (the mean of the last ones)
RTF_PASSES = 2


@dataclass(frozen=True)
class PassRecord:
    """What one decoding pass did (for benchmarks and the lossless test).

    Attributes:
        audio_start_s, audio_end_s: the window's audio (seconds from stream start); ``audio_end_s`` is the pass's
            fixed position.
        tokens: the hypothesis (end-of-text excluded, timestamps included), after the guards.
        raw_tokens: the decoder's output before the guards.
        target_steps: target decoder forwards of the request; drafted: whether a previous hypothesis drafted it.
        encode_s, decode_s, wall_s: encoder batch time, decode time (submit to done, encode excluded), pass time.
        no_speech_prob, avg_logprob: Whisper's silence measures of the window; silent: the silence rule held.
        window: the log-mel window ``[80, 3000]`` (only with ``StreamConfig.keep_windows``).
        history: the earlier text the window was prompted with (``<|startofprev|>``).
        prefix: the committed tokens forced after ``<|startoftranscript|>`` (``tokens`` starts with them).
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
    avg_logprob: float = 0.0
    silent: bool = False
    window: np.ndarray | None = None
    history: tuple[int, ...] = ()
    prefix: tuple[int, ...] = ()


@dataclass(frozen=True)
class StreamConfig:
    """Knobs of :class:`StreamingRecognizer` (seconds of audio unless said otherwise).

    Attributes:
        hop_s: passes run at every multiple of this much audio.
        agree_span_s: text is committed once the hypotheses of this much audio agree on it (LocalAgreement over
            the span); 0: the previous hypothesis only (LocalAgreement-2, lowest latency).
        max_final_gap_s: the most audio between two finals while speech is pending (a guarantee; at least
            ``agree_span_s + 2 * hop_s``). From one hop before it, a pass commits what the last two hypotheses agree
            on, and when they agree on nothing, the most recent hypothesis's words up to its position, at word
            boundaries from the word timestamps (cross-attention DTW).
        trim_after_s: a buffer longer than this is cut at the end of a committed segment ...
        keep_s: ... that leaves at least this much audio (with its committed text, the context of what follows).
        max_buffer_s: a buffer this long commits every complete segment (everything, without one) and is cut
            (Whisper sees at most 30 s).
        max_backlog_s: audio received but not yet decoded beyond which a driver should stop reading its source
            (the server stops reading the socket: backpressure). The recognizer itself never drops audio.
        prompt_chars: about this many characters of earlier committed text condition each window.
        max_new_tokens: tokens decoded per window at most.
        language: language code of multilingual models.
        no_speech_threshold, log_prob_threshold: the silence rule (faster-whisper's defaults).
        max_compression_ratio: gzip ratio of the hypothesis text above which it is treated as a loop.
        max_repeats: a token pattern (1..8 tokens) repeated this many times in a row is a loop.
        utterance_pause_s: after this much silence with everything committed, the buffer is cut.
        speculate: draft with the previous hypothesis + n-gram (False: one token per decoder step).
        catch_up_s: clock seconds a pass may start behind the audio of its position. When the audio at the next
            position arrived longer ago than this (the passes take longer than the hop), the pass moves forward to
            the latest position whose audio has arrived, so finals stay a few passes behind the clock instead of
            falling further behind with every pass (whisper_streaming's online processor likewise decodes all the
            audio received since its last iteration). The jump stops at the final-gap deadline (one hop before
            ``max_final_gap_s`` from the last commit) and at ``max_buffer_s``, so the guarantees in audio still
            hold, and it skips positions only, never audio (every pass decodes the buffer from its start). None
            (the default): passes at every fixed position, whatever the backlog, so the finals depend on the audio
            alone and never on the machine's speed. Off by default because it costs accuracy where the passes fall
            behind by much: on the WebSocket at real-time pace with one torch thread, tiny.en's finals read at WER
            0.25 with ``catch_up_s=1`` against 0.083 without (``docs/streaming.md``).
        keep_windows: keep each pass's log-mel window in its :class:`PassRecord` (tests).
    """

    hop_s: float = 0.5
    agree_span_s: float = 0.0
    max_final_gap_s: float = 3.0
    trim_after_s: float = 20.0
    keep_s: float = 10.0
    max_buffer_s: float = 28.0
    max_backlog_s: float = 30.0
    prompt_chars: int = 200
    max_new_tokens: int = 160
    language: str = "en"
    no_speech_threshold: float | None = 0.6
    log_prob_threshold: float | None = -1.0
    max_compression_ratio: float = 2.4
    max_repeats: int = 4
    utterance_pause_s: float = 0.6
    speculate: bool = True
    catch_up_s: float | None = None
    keep_windows: bool = False
    vad: VadConfig = field(default_factory=VadConfig)

    def __post_init__(self):
        if not self.hop_s > 0:
            raise ValueError(f"hop_s must be > 0, got {self.hop_s}")
        if not self.agree_span_s >= 0:
            raise ValueError(f"agree_span_s must be >= 0, got {self.agree_span_s}")
        if not self.hop_s <= self.trim_after_s <= self.max_buffer_s <= WINDOW_S - self.hop_s:
            raise ValueError(f"need hop_s <= trim_after_s <= max_buffer_s <= {WINDOW_S:g} - hop_s, got "
                             f"{self.hop_s}, {self.trim_after_s}, {self.max_buffer_s}")
        if not self.max_final_gap_s > 0:  # the gap in force is never below the span + two hops (_gap_limits)
            raise ValueError(f"max_final_gap_s must be > 0, got {self.max_final_gap_s}")
        if not self.max_backlog_s > 0:
            raise ValueError(f"max_backlog_s must be > 0, got {self.max_backlog_s}")
        if self.catch_up_s is not None and not self.catch_up_s >= 0:
            raise ValueError(f"catch_up_s must be >= 0 or None, got {self.catch_up_s}")


@dataclass(frozen=True)
class WindowDecode:
    """A decoded window from :class:`SpeechService`."""

    tokens: tuple[int, ...]
    finish_reason: str | None
    target_steps: int
    no_speech_prob: float
    avg_logprob: float
    encode_s: float
    decode_s: float
    cross_kv: object | None = None  # the window's cross-attention K/V (``keep_encoder=True`` only; word times)


# -- the shared model and engine ------------------------------------------------------------------------------
@dataclass
class AudioWindow:
    """The multimodal input of one subtitle window: its log-mel window and the no-speech probe's prefix going in;
    the probe's probability and the encode time coming out (the runner's encoder fills them)."""

    mel: np.ndarray
    probe_prefix: list[int]
    no_speech_prob: float = 0.0
    encode_s: float = 0.0
    keep_encoder: bool = False
    cross_kv: object | None = None  # filled by the encoder when ``keep_encoder``


class SpeechService:
    """The Whisper model in the device loop (model ``"whisper"``), shared by every stream of the process.

    Each window is one ``realtime`` request whose audio window travels as its multimodal input
    (``Request.mm_inputs``); the loop's scheduler batches windows of every stream into encoder batches, beside the
    other models' work. The runner's audio encoder runs the Hugging Face encoder on a batch, projects the outputs
    into cross-attention keys/values once (``CrossKV`` of :mod:`specstream.stages.speculative.models.whisper`,
    copied by the prefill and by the probe) and probes the no-speech probability; its prefill hook hands the keys
    and values to the decoder. The engine returns each token's log-probability (``Request.logprobs``), from which
    the window's average log-probability comes.

    Args:
        model: a loaded :class:`~specstream.stages.speech.SpeechModel`, a name (``"tiny.en"``, ``"whisper-base"``)
            or a checkpoint path (default: tiny.en).
        num_slots: concurrent windows in the KV cache (one per active stream is enough).
        metrics: :class:`~specstream.schedulers.metrics.SchedulerMetrics` for a loop of its own, or None.
        loop: the device loop to join (the process's one loop); None: a loop of its own.
        name: the model's name in the loop.
    """

    def __init__(self, model=None, num_slots: int = 16, metrics=None, max_encode_batch: int = 8, loop=None,
                 name: str = "whisper"):
        from specstream.schedulers.qos import EncodeBatching
        from specstream.stages.device_loop import DeviceLoop, ModelRunner, new_qos_scheduler
        from specstream.stages.speculative.drafters.ngram import NgramDrafter
        from specstream.stages.speculative.drafters.temporal import TemporalDrafter
        from specstream.stages.speculative.executor import SpeculativeExecutor
        from specstream.stages.speech import SpeechModel

        self.model = model if isinstance(model, SpeechModel) else SpeechModel.load(model)
        sm = self.model
        self.temporal = TemporalDrafter()
        drafters = [self.temporal, NgramDrafter(max_ngram=3, max_branches=2, max_depth=8)]
        max_len = sm.max_target_positions
        full = 17
        executor = SpeculativeExecutor(sm.decoder, drafters, num_slots, max_len, full_nodes=full)
        # tree sizes from acceptance alone, never from measured times: a transcript (and a Kafka transcribe
        # result, which must repeat exactly on redelivery) must not depend on how loaded the machine is
        executor.cost_aware = False
        cross = sm.decoder.config
        enc_bytes = 2 * cross.decoder_layers * cross.d_model * 1500 * 4  # one window's cross-attention K/V
        self.runner = ModelRunner(name, executor, sm.tokenizer, (sm.tokens.eot,), max_len,
                                  requires_encoder_output=True, encoder_bytes=num_slots * enc_bytes)
        self.runner.register_encoder("audio", self._encode)
        self.runner.set_prefill_hook(self._prefill_inputs)
        self._enc_bytes = enc_bytes
        if loop is None:
            sched = new_qos_scheduler(metrics=metrics, token_budget=max(1024, num_slots * (full + 1)),
                                      max_nodes_per_request=full, max_tree_depth=16, preempt=False,
                                      max_queue={"realtime": 4 * num_slots, "interactive": 256, "batch": 4096},
                                      encoders={"audio": EncodeBatching(max_encode_batch, 0.0)})
            loop = DeviceLoop([], sched, device=str(sm.decoder.device))
        loop.add_runner(self.runner)
        self.loop = loop
        sm.bind(loop, name)  # offline transcriptions with this model run in the loop too
        self._ids = itertools.count()
        self._word_start: dict[int, bool] = {}
        self.encode_batches: list[tuple[int, float]] = []  # (batch size, seconds)
        #: mean seconds per decoding pass measured by the streams of this service (None: not yet); a new stream
        #: whose hop is shorter warns on its first pass (:class:`StreamWarning`)
        self.pass_s: float | None = None

    def observe_pass(self, seconds: float) -> None:
        """A stream's measured seconds per decoding pass (exponential mean over the service's streams)."""
        self.pass_s = seconds if self.pass_s is None else 0.7 * self.pass_s + 0.3 * seconds

    @property
    def executor(self):
        return self.runner.executor

    async def start(self) -> None:
        self.loop.start()

    async def stop(self) -> None:
        """Nothing of its own to stop: the device loop's owner stops the loop."""

    def _encode(self, items) -> None:
        """The runner's audio encoder (device thread): one encoder batch for the windows of several streams."""
        t0 = time.perf_counter()
        windows: list[AudioWindow] = [mm.data for _, mm in items]
        enc = self.model.encode(np.stack([w.mel for w in windows]))
        kvs = self.model.decoder.project(enc)  # once: the prefill and the probe copy them
        probs = [self.model.no_speech_prob(kv, w.probe_prefix) for w, kv in zip(windows, kvs)]
        dt = time.perf_counter() - t0
        self.encode_batches.append((len(items), dt))
        for (state, mm), kv, p in zip(items, kvs, probs):
            state.mm_outputs[mm.item_id] = kv
            mm.data.no_speech_prob, mm.data.encode_s = p, dt
            if mm.data.keep_encoder:
                mm.data.cross_kv = kv

    @staticmethod
    def _prefill_inputs(state) -> None:
        """The runner's prefill hook: the window's cross-attention keys/values go to the decoder."""
        (kv,) = state.mm_outputs.values()
        state.encoder_output = kv

    async def decode_window(self, window: np.ndarray, hypothesis: Sequence[int] | None = None,
                            speculate: bool = True, max_new_tokens: int = 160, seconds: float = 30.0,
                            previous_text: Sequence[int] = (), language: str = "en",
                            timestamps: bool = True, prefix: Sequence[int] = (),
                            keep_encoder: bool = False) -> WindowDecode:
        """Encode and greedy-decode one log-mel window ``[n_mels, 3000]`` as ``realtime`` work.

        Args:
            hypothesis: the previous hypothesis of this stream (drafts; None for none).
            seconds: audio seconds in the window (the cost model's encode units).
            previous_text: token ids of text said before the window (committed earlier): the prompt becomes
                ``<|startofprev|> previous_text <|startoftranscript|> ...`` (whisper_streaming's context).
            timestamps: decode Whisper's timestamp tokens (segments).
            prefix: tokens forced after the ``<|startoftranscript|>`` sequence (text already committed, with its
                timestamps); the decoder continues after them and the result excludes them. The timestamp rules
                count them as written (their history starts before the prefix).
            keep_encoder: return the window's cross-attention keys/values (``WindowDecode.cross_kv``, e.g. 18 MB
                for tiny in float32) for word timestamps (:meth:`word_ends`).

        Raises:
            CapacityError: the realtime queue is full; SpecstreamError: decoding failed or ended early.
        """
        from specstream.errors import SpecstreamError

        self.loop.start()
        sm = self.model
        req, audio = self.window_request(window, hypothesis, speculate, max_new_tokens, seconds, previous_text,
                                         language, timestamps, prefix)
        audio.keep_encoder = keep_encoder
        rid = req.request_id
        t0 = time.perf_counter()
        done = await self.loop.submit(req)
        wall = time.perf_counter() - t0
        if done.error:
            raise SpecstreamError(f"decoding failed: {done.error}")
        if done.finish_reason not in ("eos", "length"):  # cut short: an error, never an empty hypothesis
            raise SpecstreamError(f"decoding of window {rid!r} ended early ({done.finish_reason})")
        toks = tuple(t for t in done.output_ids if t != sm.tokens.eot)
        avg = float(sum(done.output_logprobs)) / (len(toks) + 1)
        kv, audio.cross_kv = audio.cross_kv, None
        return WindowDecode(toks, done.finish_reason, done.stats.target_steps, audio.no_speech_prob, avg,
                            audio.encode_s, max(0.0, wall - audio.encode_s), kv)

    async def word_ends(self, cross_kv, text: Sequence[int], frames: int, language: str = "en") -> list[tuple[int, float]]:
        """Word boundaries of a window's text tokens: ``[(index after the word, end s from the window start)]``
        by cross-attention DTW (:meth:`~specstream.stages.speech.SpeechModel.align`, on the device loop's thread
        between two steps). Empty when the alignment's words do not cover ``text`` exactly.

        Args:
            cross_kv: ``WindowDecode.cross_kv`` of the window; text: its text tokens (no timestamps);
            frames: mel frames of audio in the window (100 per second).
        """
        words = await asyncio.to_thread(self.model.align, cross_kv, list(text), frames, language)
        out, i = [], 0
        for w in words:
            i += len(w.tokens)
            out.append((i, float(w.end)))
        return out if i == len(text) else []

    def window_request(self, window: np.ndarray, hypothesis: Sequence[int] | None = None, speculate: bool = True,
                       max_new_tokens: int = 160, seconds: float = 30.0, previous_text: Sequence[int] = (),
                       language: str = "en", timestamps: bool = True, prefix: Sequence[int] = ()):
        """The ``realtime`` request of one window (arguments as :meth:`decode_window`) and its
        :class:`AudioWindow` (the encoder fills its probe result). Returns ``(request, audio_window)``."""
        from specstream.schedulers.plan import MMInput

        sm = self.model
        head = sm.prompt(language, "transcribe", timestamps, previous_text)
        prompt = head + [int(t) for t in prefix]
        rid = f"win-{next(self._ids)}"
        audio = AudioWindow(window, prompt[:prompt.index(sm.tokens.sot) + 1])
        limit = max(1, min(max_new_tokens, sm.max_target_positions - len(prompt)))
        req = self.runner.make_request(prompt, limit, request_id=rid, speculate=speculate, qos="realtime",
                                       mm_inputs=(MMInput(f"{rid}/audio", "audio", audio, float(seconds),
                                                          self._enc_bytes),),
                                       logprobs=True,
                                       logits_processors=sm.logits_processors(len(head), timestamps=timestamps),
                                       draft_hypothesis=tuple(hypothesis) if hypothesis and speculate else None)
        return req, audio

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


@dataclass(frozen=True)
class _Seg:
    """A segment of a hypothesis: absolute times, closed by an end timestamp or not, its text tokens
    ``[first, end)`` and the raw index just after it (after its end timestamp when closed)."""

    start_s: float
    end_s: float
    complete: bool
    first: int
    end: int
    raw_end: int


@dataclass
class _Hyp:
    """One pass's hypothesis: the committed prefix + what the decoder wrote (``raw``, timestamps relative to the
    window start), its text tokens, the raw index of each, and its segments."""

    pos: int  # absolute sample position of the pass (the window's end)
    start: int  # absolute sample position of the window's start
    raw: list[int]
    text: list[int]
    raw_at: list[int]
    segments: list[_Seg]
    complete: bool  # ends with a closed segment (Whisper finished what it heard)
    word_ends: list[tuple[int, float]] = field(default_factory=list)  # (text index after a word, end s absolute)

    def seg_of(self, i: int) -> _Seg:
        return next(s for s in self.segments if s.first <= i < s.end)


# -- the recognizer ---------------------------------------------------------------------------------------------
class StreamingRecognizer:
    """Live subtitles of one audio stream (see the module docstring).

    The text committed in the current buffer is forced as a decoder prefix (with its timestamp tokens) after
    ``<|startoftranscript|>``, so every hypothesis starts with exactly the committed tokens and the agreement
    compares what follows; earlier text that left the buffer conditions the window as ``<|startofprev|>`` history.

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
        self.buffer = RingBuffer(int((self.config.max_buffer_s + self.config.max_backlog_s) * SAMPLE_RATE))
        self._hop = max(1, int(round(self.config.hop_s * SAMPLE_RATE)))
        self._tb = service.model.tokens.timestamp_begin
        self._eot = service.model.tokens.eot
        self._next_pos = self._hop  # the next pass's fixed position (absolute sample)
        self._last_pos = 0  # the last pass's position
        self._history: list[int] = []  # committed text tokens already cut from the buffer (the prompt)
        self._arrivals: list[tuple[int, float]] = []  # (absolute sample end, clock at arrival)
        self._prefix: list[int] = []  # committed tokens of the buffer, timestamps relative to its start
        self._committed: list[int] = []  # their text tokens
        self._hyps: list[_Hyp] = []  # recent hypotheses of the current buffer, oldest first
        self._last_commit_pos = 0  # position of the last pass that committed, or since when nothing waits
        self._last_end_s = 0.0  # end of the last final
        self._partial = ""
        self._pass_clock: list[float] = []  # clock seconds of each decoding pass
        self._warned = False
        self.passes: list[PassRecord] = []
        #: hop positions the passes skipped to catch up with the clock (``StreamConfig.catch_up_s``)
        self.skipped_positions = 0
        self.finals: list[Subtitle] = []
        self.warnings: list[StreamWarning] = []
        self.finished = False

    # -- the contract -----------------------------------------------------------------------------------------
    @property
    def audio_end_s(self) -> float:
        return self.buffer.end / SAMPLE_RATE

    @property
    def decoded_until_s(self) -> float:
        """Audio position of the last pass (every sample before it went through a pass or the VAD gate)."""
        return self._last_pos / SAMPLE_RATE

    @property
    def backlog_s(self) -> float:
        """Seconds of received audio that no pass has reached yet (grows when the recognizer falls behind)."""
        return self.audio_end_s - self.decoded_until_s

    def insert_audio(self, samples: np.ndarray, arrived_at: float | None = None) -> None:
        """Append 16 kHz mono float32 ``samples`` ``[n]``; the VAD labels them at once. Never drops audio.

        ``arrived_at``: the clock time the samples arrived (default: now); finals' ``latency_ms`` count from
        it (a benchmark passes the scheduled arrival, so time spent before the insert counts too).

        Raises:
            RuntimeError: after :meth:`finish`; ValueError: non-finite samples (nothing is inserted).
        """
        if self.finished:
            raise RuntimeError("stream finished")
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        if not len(x):
            return
        if not np.isfinite(x).all():
            raise ValueError("audio samples must be finite (NaN or Inf found)")
        self.buffer.append(x)
        self._arrivals.append((self.buffer.end, self.clock() if arrived_at is None else float(arrived_at)))
        self.vad.accept(x)

    def ready(self) -> bool:
        """A pass is due: the audio reached the next fixed position."""
        return not self.finished and self.buffer.end >= self._next_pos

    async def process(self) -> list[Subtitle]:
        """One pass at the next fixed position (when :meth:`ready`; a no-op otherwise). Returns new subtitles, and
        once per stream a :class:`StreamWarning` when its passes cannot keep up with real time."""
        if not self.ready():
            return []
        pos = self._catch_up(self._next_pos)
        self._next_pos = pos + self._hop
        out: list = []
        if not self.passes and not self._warned and self.service.pass_s is not None:  # known before this stream
            out.extend(self._rtf_warning(self.service.pass_s))
        return out + await self._pass(pos, final=False)

    async def finish(self) -> list[Subtitle]:
        """End of stream: run the passes still due, then decode what is left and commit all of it."""
        if self.finished:
            return []
        out: list[Subtitle] = []
        while self.ready():
            out.extend(await self.process())
        if self.buffer.end > self._last_pos or self._pending():
            out.extend(await self._pass(self.buffer.end, final=True))
        self.finished = True
        if self._partial:
            out.append(self._emit_partial(""))
        return out

    # -- a pass ------------------------------------------------------------------------------------------------
    def _catch_up(self, pos: int) -> int:
        """The position of the pass due at ``pos`` (absolute sample, a multiple of the hop): ``pos`` itself, or
        when its audio arrived more than ``catch_up_s`` of clock ago, the latest hop position whose audio has
        arrived, but not past the final-gap deadline, one hop before ``max_final_gap_s`` from the last commit (a
        pass there commits the words that ended a hop before it, by word times; the next one, whatever is left
        but the trailing word: the gap in audio still holds), nor past ``max_buffer_s`` from the buffer's
        start."""
        lim = self.config.catch_up_s
        end, hop = self.buffer.end, self._hop
        latest = end - end % hop
        if lim is None or latest <= pos or self.clock() - self._arrival_clock(pos / SAMPLE_RATE) <= lim:
            return pos
        deadline = self._gap_limits()[0] + FRAME  # (without its one frame of slack: a whole number of hops)
        cap = min(latest, self.buffer.start + int(round(self.config.max_buffer_s * SAMPLE_RATE)),
                  self._last_commit_pos + deadline)
        new = max(pos, cap - cap % hop)
        self.skipped_positions += (new - pos) // hop
        return new

    def _pending(self) -> bool:
        return bool(self._hyps) and len(self._hyps[-1].text) > len(self._committed)

    def _rtf_warning(self, pass_s: float) -> list[StreamWarning]:
        """A :class:`StreamWarning` when passes of ``pass_s`` seconds cannot keep up with ``hop_s`` (once)."""
        hop = self.config.hop_s
        rtf = pass_s / hop
        if self._warned or not rtf > 1.0:
            return []
        self._warned = True
        then = ("so passes skip to the newest audio to stay near the clock (finals come in larger steps)"
                if self.config.catch_up_s is not None else "so finals fall further behind the clock")
        w = StreamWarning("falling_behind", f"this stream cannot keep up with real time: a decoding pass takes "
                          f"{pass_s:.2f} s per {hop:.2f} s of audio (real-time factor {rtf:.2f}), {then}; no audio "
                          f"is lost. A smaller model, a longer hop (min_hop_s) or quantized weights help.",
                          rtf, pass_s, hop, self.clock())
        self.warnings.append(w)
        return [w]

    def _measure(self, seconds: float) -> list[StreamWarning]:
        """Book one decoding pass's clock time; the warning once the mean of the last passes is over the hop."""
        self._pass_clock.append(seconds)
        if len(self._pass_clock) < RTF_PASSES:
            return []
        mean = sum(self._pass_clock[-RTF_PASSES:]) / RTF_PASSES
        self.service.observe_pass(mean)
        return self._rtf_warning(mean)

    async def _pass(self, pos: int, final: bool) -> list[Subtitle]:
        t0 = time.perf_counter()
        c0 = self.clock()
        out: list[Subtitle] = []
        prev_pos, self._last_pos = self._last_pos, pos
        start = self.buffer.start
        n_passes = len(self.passes)
        if not self._speech(start, pos):  # the VAD gate: no speech in the buffer, nothing to decode
            if self._pending():  # text Whisper heard where the VAD did not: committed, never dropped
                out.extend(self._commit(self._hyps[-1], True))
            if self._partial:
                out.append(self._emit_partial(""))
            self._reset_buffer(max(start, pos - SAMPLE_RATE // 2))
            return out
        if not final and not self._pending() and self._hyps and not self._speech(prev_pos, pos) \
                and not self._unread(self._hyps[-1], pos):
            self._maybe_end_utterance(pos)  # nothing new was said, nothing waits, all speech was read
            self._last_commit_pos = pos  # nothing waits: the gap to the next final starts here
            return out
        hyp = await self._decode(start, pos)
        out.extend(self._commit(hyp, final))
        if final:
            out.extend(await self._finish_rest(hyp))
        else:
            out.extend(self._trim(hyp, pos))
        if len(self.passes) > n_passes:
            self.passes[n_passes] = replace(self.passes[n_passes], wall_s=time.perf_counter() - t0)
            if not final:
                out.extend(self._measure(self.clock() - c0))
        return out

    async def _finish_rest(self, hyp: _Hyp) -> list[Subtitle]:
        """After the final pass committed its hypothesis: when speech follows the last closed segment but
        Whisper did not read it (its long-form decoding can stop early), cut there and decode the rest."""
        out: list[Subtitle] = []
        end = self.buffer.end
        for _ in range(8):
            done = [s for s in hyp.segments if s.complete]
            if not done or not self._unread(hyp, end):
                break
            cut = self._snap(int(round(done[-1].end_s * SAMPLE_RATE)), end)
            if cut <= self.buffer.start:
                break
            self._cut(cut, hyp, done[-1])
            hyp = await self._decode(self.buffer.start, end)
            out.extend(self._commit(hyp, True))
        return out

    async def _decode(self, a: int, b: int) -> _Hyp:
        """Decode the buffer's samples ``[a, b)`` (prompted with earlier text, forced to start with the committed
        prefix, drafted by the previous hypothesis); records a :class:`PassRecord`; returns the hypothesis."""
        from specstream.stages.speech import no_speech
        from specstream.stages.whisper_timing import split_timestamped

        cfg = self.config
        sm = self.service.model
        audio = self.buffer.view(a, b)
        window, frames = mel_window(log_mel(audio, sm.num_mel_bins), 0)
        history = self._prompt_tokens()
        prev = self._hyps[-1] if self._hyps else None
        draft = prev.raw[len(self._prefix):] if (prev is not None and cfg.speculate and prev.start == a
                                                 and prev.raw[:len(self._prefix)] == self._prefix) else None
        due = self._deadline_due(b)
        dec = await self.service.decode_window(window, draft, speculate=cfg.speculate,
                                               max_new_tokens=cfg.max_new_tokens, seconds=len(audio) / SAMPLE_RATE,
                                               previous_text=history, language=cfg.language, prefix=self._prefix,
                                               keep_encoder=due)
        silent = no_speech(dec.no_speech_prob, dec.avg_logprob, cfg.no_speech_threshold, cfg.log_prob_threshold)
        gen = [] if silent else list(dec.tokens)
        loop = repetition_cut(gen, cfg.max_repeats)
        if loop is not None:
            gen = gen[:loop]
        if compression_ratio(self.service.text(gen)) > cfg.max_compression_ratio:
            gen, loop = [], 0
        raw = self._prefix + gen
        split = split_timestamped(raw, self._tb, a / SAMPLE_RATE, frames)
        text: list[int] = []
        raw_at: list[int] = []
        segments: list[_Seg] = []
        r = 0
        for s in split.segments + ([split.tail] if split.tail is not None else []):
            first = len(text)
            for t in s.tokens:
                if t < self._eot:
                    text.append(t)
                    raw_at.append(r)
                r += 1
            if len(text) > first:  # a segment without text (a lone timestamp) carries nothing
                segments.append(_Seg(s.start_s, min(s.end_s, b / SAMPLE_RATE), s.complete, first, len(text), r))
        complete = loop is None and dec.finish_reason == "eos" and (not segments or segments[-1].complete)
        hyp = _Hyp(b, a, raw, text, raw_at, segments, complete)
        if due and dec.cross_kv is not None and len(text) > len(self._committed):  # word times for the deadline
            t0 = a / SAMPLE_RATE
            hyp.word_ends = [(j, t0 + e) for j, e in
                             await self.service.word_ends(dec.cross_kv, text, frames, cfg.language)]
        self.passes.append(PassRecord(a / SAMPLE_RATE, b / SAMPLE_RATE, tuple(raw), dec.tokens, dec.target_steps,
                                      draft is not None, dec.encode_s, dec.decode_s, 0.0, dec.no_speech_prob,
                                      dec.finish_reason, round(dec.avg_logprob, 4), silent,
                                      window if cfg.keep_windows else None, tuple(history), tuple(self._prefix)))
        return hyp

    def _prompt_tokens(self) -> list[int]:
        """The last ~``prompt_chars`` characters of committed text that left the buffer, whole words."""
        h = self._history[-max(8, self.config.prompt_chars // 2):]
        i = 0
        while i < len(h) and (not self.service.starts_word(h[i])
                              or len(self.service.text(h[i:])) > self.config.prompt_chars):
            i += 1
        return h[i:]

    # -- VAD queries (frames wholly before a pass position: what the pass may know) ---------------------------
    def _frames(self, a: int, b: int) -> tuple[int, int]:
        return max(0, a // FRAME), min(self.vad.frames, b // FRAME)

    def _speech(self, a: int, b: int) -> bool:
        fa, fb = self._frames(a, b)
        return any(self.vad.speech[fa:fb])

    def _last_speech_end(self, a: int, b: int) -> int | None:
        fa, fb = self._frames(a, b)
        for i in range(fb - 1, fa - 1, -1):
            if self.vad.speech[i]:
                return (i + 1) * FRAME
        return None

    # -- committing --------------------------------------------------------------------------------------------
    def _gap_limits(self) -> tuple[int, int]:
        """(deadline, gap) in samples since the last commit: from ``deadline`` a pass commits whatever it can;
        ``gap`` (``max_final_gap_s``, at least the span + two hops) is the most audio between two finals."""
        cfg = self.config
        gap = max(cfg.max_final_gap_s, cfg.agree_span_s + 2 * cfg.hop_s)  # never undercuts the span
        return int(round((gap - cfg.hop_s) * SAMPLE_RATE)) - FRAME, int(round(gap * SAMPLE_RATE)) - FRAME

    def _deadline_due(self, pos: int) -> bool:
        return pos - self._last_commit_pos >= self._gap_limits()[0]

    def _deadline_words(self, hyp: _Hyp, a: int) -> int | None:
        """Where the deadline cuts ``hyp``'s uncommitted text ``[a, ...)`` when passes agree on nothing: after the
        last whole word that ended (word timestamps) at least one hop before the pass position, and never inside
        the trailing word of an unfinished hypothesis (it may still grow). On the last pass before the gap would
        exceed ``max_final_gap_s``, all but that trailing word."""
        n = len(hyp.text)
        open_end = not (hyp.complete and hyp.segments and hyp.segments[-1].complete)

        def boundary(j: int) -> bool:
            return a < j <= n and (j < n and self.service.starts_word(hyp.text[j]) or (j == n and not open_end))

        limit_s = (hyp.pos - self._hop) / SAMPLE_RATE
        ok = [j for j, end_s in hyp.word_ends if end_s <= limit_s and boundary(j)]
        if ok:
            return max(ok)
        if hyp.pos - self._last_commit_pos >= self._gap_limits()[1]:
            j = n if not open_end else self._word_floor(hyp.text, a, n - 1)
            return j if j > a else None
        return None

    def _word_floor(self, text: list[int], a: int, j: int) -> int:
        """``j`` moved back to a word start (the last word may still grow), not below ``a``."""
        while j > a and not (j < len(text) and self.service.starts_word(text[j])):
            j -= 1
        return j

    def _commit(self, hyp: _Hyp, final: bool) -> list[Subtitle]:
        """The commit policy (module docstring); returns the final and/or partial."""
        cfg = self.config
        out: list[Subtitle] = []
        a = len(self._committed)
        width = int(round(max(cfg.agree_span_s, cfg.hop_s) * SAMPLE_RATE))
        earlier = [h.pos for h in self._hyps if h is not hyp and h.pos < hyp.pos]
        if earlier:  # the span reaches at least the previous pass, however far back the catch-up left it
            width = max(width, hyp.pos - max(earlier))
        refs = [h for h in self._hyps if h is not hyp and h.pos >= hyp.pos - width - FRAME
                and h.text[:a] == self._committed]
        covered = any(h.pos <= hyp.pos - width + FRAME for h in refs)  # the span is wholly behind this pass
        if hyp not in self._hyps:
            self._hyps.append(hyp)
        self._hyps = [h for h in self._hyps if h.pos >= hyp.pos - width - self._hop - FRAME]
        new = hyp.text[a:]
        to = None
        if final:
            to = len(hyp.text)
        elif refs and covered:
            agree = min(_lcp(new, r.text[a:]) for r in refs)
            if agree == len(new) and hyp.complete and all(r.complete and len(r.text) == len(hyp.text) for r in refs):
                to = len(hyp.text)  # speech ended: everything, identical over the span
            else:  # whole closed segments only, and not the last while speech goes on after it: a sentence
                # reads best once Whisper heard it to its end and the start of the next (as the offline windows do)
                ends = [s.end for i, s in enumerate(hyp.segments) if s.complete and a < s.end <= a + agree
                        and (i + 1 < len(hyp.segments) or hyp.complete)]
                to = max(ends) if ends else None
        if (to is None or to <= a) and new and self._deadline_due(hyp.pos):
            if refs:
                last = max(refs, key=lambda h: h.pos)  # the deadline: what the last two hypotheses agree on,
                agree = _lcp(new, last.text[a:])  # whole closed segments of it if any, else whole words
                ends = [s.end for s in hyp.segments if s.complete and a < s.end <= a + agree]
                if ends:
                    to = max(ends)
                elif cfg.agree_span_s == 0:  # whole words only at the lowest-latency setting
                    to = self._word_floor(hyp.text, a, a + agree)
            if to is None or to <= a:  # they agree on nothing: this pass's words, up to its position
                to = self._deadline_words(hyp, a)
        if to is not None and to > a:
            out.extend(self._emit_finals(hyp, a, to))
            self._set_prefix(hyp, to)
            self._last_commit_pos = hyp.pos
        if len(hyp.text) <= len(self._committed):
            self._last_commit_pos = hyp.pos
        rest = hyp.text[len(self._committed):]
        text = self.service.text(rest) if rest else ""
        if text != self._partial:
            out.append(self._emit_partial(text))
        return out

    def _set_prefix(self, hyp: _Hyp, to: int) -> None:
        """The committed prefix becomes ``hyp``'s raw tokens through text token ``to - 1`` (and the segment's end
        timestamp when ``to`` closes a segment)."""
        seg = hyp.seg_of(to - 1)
        end = seg.raw_end if (to == seg.end and seg.complete) else hyp.raw_at[to - 1] + 1
        self._prefix = list(hyp.raw[:end])
        self._committed = list(hyp.text[:to])

    def _force(self, hyp: _Hyp) -> list[Subtitle]:
        """The buffer reached ``max_buffer_s``: commit every closed segment (everything without one)."""
        a = len(self._committed)
        done = [s for s in hyp.segments if s.complete]
        to = done[-1].end if done else len(hyp.text)
        if to <= a:
            return []
        out = self._emit_finals(hyp, a, to)
        self._set_prefix(hyp, to)
        self._last_commit_pos = hyp.pos
        return out

    # -- emitting ------------------------------------------------------------------------------------------------
    def _bounds(self, hyp: _Hyp, seg: _Seg) -> tuple[float, float]:
        """A segment's times, tightened by the VAD: Whisper often starts a segment at the end of the pause before
        it (``<|0.00|>`` at the window start); the speech in it starts at the first VAD speech frame and ends at the
        last one (up to 0.3 s past its end timestamp, not into the next segment). An unfinished segment ends where
        the VAD last heard speech before the pass position."""
        s0, s1 = seg.start_s, seg.end_s
        nxt = next((x.start_s for x in hyp.segments if x.first >= seg.end), None)
        limit = hyp.pos if not seg.complete else int(round(min(s1 + 0.3, nxt if nxt is not None else 1e9)
                                                           * SAMPLE_RATE))
        limit = min(limit, hyp.pos)
        fa, fb = self._frames(int(s0 * SAMPLE_RATE), limit)
        onset = next((i for i in range(fa, fb) if self.vad.speech[i]), None)
        if onset is None:
            return s0, (s1 if seg.complete else hyp.pos / SAMPLE_RATE)
        last = max(i for i in range(onset, fb) if self.vad.speech[i])
        return max(s0, onset * FRAME / SAMPLE_RATE), (last + 1) * FRAME / SAMPLE_RATE

    def _time_at(self, hyp: _Hyp, i: int, end: bool) -> float:
        """Audio time of text index ``i`` of ``hyp`` (its start, or with ``end`` the end of token ``i - 1``), from
        its segment's timestamps (tightened by the VAD); inside a segment, shared out in proportion to the
        characters."""
        seg = hyp.seg_of(min(len(hyp.text) - 1, i - 1 if end else i))
        s0, s1 = self._bounds(hyp, seg)
        if end and i >= seg.end:
            return s1
        if not end and i <= seg.first:
            return s0
        whole = len(self.service.text(hyp.text[seg.first:seg.end])) or 1
        part = len(self.service.text(hyp.text[seg.first:i]))
        return s0 + (s1 - s0) * min(1.0, part / whole)

    def _emit_finals(self, hyp: _Hyp, a: int, b: int) -> list[Subtitle]:
        """Finals for text tokens ``[a, b)`` of ``hyp``: one per segment they touch (a subtitle per segment)."""
        cuts = sorted({a, b} | {s.end for s in hyp.segments if a < s.end < b})
        return [self._emit_final(hyp, x, y) for x, y in zip(cuts, cuts[1:])]

    def _emit_final(self, hyp: _Hyp, a: int, b: int) -> Subtitle:
        """A final for text tokens ``[a, b)`` of ``hyp``."""
        start = max(self._last_end_s, self._time_at(hyp, a, False))
        fa, fb = self._frames(int(self._last_end_s * SAMPLE_RATE), int(start * SAMPLE_RATE))
        onset = next((i for i in range(fa, fb) if self.vad.speech[i]), None)
        if onset is not None:  # speech between the last final and this one is this one's (text comes in order)
            start = max(self._last_end_s, onset * FRAME / SAMPLE_RATE)
        end = max(start, min(hyp.pos / SAMPLE_RATE, self._time_at(hyp, b, True)))
        tokens = hyp.text[a:b]
        now = self.clock()
        sub = Subtitle("final", self.service.text(tokens), round(start, 3), round(end, 3), now,
                       (now - self._arrival_clock(end)) * 1000.0, tuple(tokens), hyp.pos / SAMPLE_RATE)
        self._last_end_s = end
        self.finals.append(sub)
        self._partial = ""
        return sub

    def _emit_partial(self, text: str) -> Subtitle:
        self._partial = text
        return Subtitle("partial", text, round(self._last_end_s, 3),
                        round(max(self._last_end_s, self.decoded_until_s), 3), self.clock())

    def _arrival_clock(self, t_s: float) -> float:
        """Clock time at which the audio at ``t_s`` had arrived."""
        sample = int(round(t_s * SAMPLE_RATE))
        for s_end, at in self._arrivals:
            if s_end >= sample:
                return at
        return self._arrivals[-1][1] if self._arrivals else self.clock()

    # -- cutting the buffer -------------------------------------------------------------------------------------
    def _trim(self, hyp: _Hyp, pos: int) -> list[Subtitle]:
        """Cut the buffer at the end of the last committed closed segment when it is longer than
        ``trim_after_s`` or the speaker paused with everything committed; at ``max_buffer_s`` commit first."""
        cfg = self.config
        out: list[Subtitle] = []
        length = pos - self.buffer.start
        full = length >= cfg.max_buffer_s * SAMPLE_RATE - FRAME
        if full:
            out.extend(self._force(hyp))
        done = [s for s in hyp.segments if s.complete and s.end <= len(self._committed)]
        if not done:
            if full and hyp.text:  # one segment as long as the buffer: committed, cut where it was read
                self._cut(pos, hyp, hyp.segments[-1])
            elif full:  # Whisper's silence rule judged the whole buffer silent
                self._reset_buffer(pos - SAMPLE_RATE // 2)
            return out
        seg = done[-1]
        cut = int(round(seg.end_s * SAMPLE_RATE))
        pause = int(cfg.utterance_pause_s * SAMPLE_RATE)
        everything = len(self._committed) >= len(hyp.text) and hyp.complete
        if everything and self._unread(hyp, pos):  # Whisper stopped early: the next pass reads on from here
            self._cut(self._snap(cut, pos), hyp, seg)
        elif everything and not self._speech(max(cut, pos - pause), pos):
            last = self._last_speech_end(self.buffer.start, pos)  # the speaker paused, all of it committed
            self._cut(max(cut, last or cut), hyp, seg)
        elif full:
            self._cut(self._snap(cut, pos), hyp, seg)
        elif length > cfg.trim_after_s * SAMPLE_RATE:  # keep keep_s of audio (and its text) as context
            ok = [s for s in done if pos - s.end_s * SAMPLE_RATE >= cfg.keep_s * SAMPLE_RATE]
            if ok:
                self._cut(self._snap(int(round(ok[-1].end_s * SAMPLE_RATE)), pos), hyp, ok[-1])
        return out

    def _snap(self, cut: int, pos: int, reach_s: float = 0.3) -> int:
        """``cut`` moved into the VAD pause nearest to it within ``reach_s`` (timestamps are about 0.1-0.3 s off;
        cutting in the middle of a pause keeps a word from being split between two windows)."""
        reach = int(reach_s * SAMPLE_RATE) // FRAME
        c = cut // FRAME
        lo, hi = self.buffer.start // FRAME, min(self.vad.frames, pos // FRAME)
        for d in range(reach + 1):
            for f in (c - d, c + d):
                if lo < f < hi and not self.vad.speech[f]:
                    a = b = f  # the pause around frame f
                    while a - 1 > lo and not self.vad.speech[a - 1]:
                        a -= 1
                    while b + 1 < hi and not self.vad.speech[b + 1]:
                        b += 1
                    return ((a + b + 1) * FRAME) // 2
        return cut

    def _cut(self, cut: int, hyp: _Hyp, seg: _Seg) -> None:
        """Move the buffer start to ``cut`` (absolute sample), where ``seg`` (committed) ends: its text and all
        before it join the prompt history, the rest of the committed prefix is re-timed to the new start, and the
        recent hypotheses lose the same text."""
        cut = max(self.buffer.start, min(cut, hyp.pos))
        k = min(seg.end, len(self._committed))
        self._history += self._committed[:k]
        raw_k = seg.raw_end if seg.end <= len(self._committed) else len(self._prefix)
        shift = round((cut - self.buffer.start) / SAMPLE_RATE / 0.02)
        self._prefix = [t if t < self._tb else max(self._tb, t - shift) for t in self._prefix[raw_k:]]
        self._committed = self._committed[k:]
        self._hyps = [_Hyp(h.pos, cut, [], h.text[k:], [], [], h.complete) for h in self._hyps
                      if h.text[:k] == hyp.text[:k]]
        self.buffer.trim(cut)
        self._drop_old_arrivals()

    def _reset_buffer(self, new_start: int) -> None:
        """Drop the audio before ``new_start`` when nothing uncommitted is in it (silence)."""
        self._history += self._committed
        self._committed, self._prefix, self._hyps = [], [], []
        self.buffer.trim(new_start)
        self._last_commit_pos = max(self._last_commit_pos, self._last_pos)
        self._drop_old_arrivals()

    def _read_until(self, hyp: _Hyp) -> int:
        """Absolute sample up to which ``hyp`` read the audio: the end of its last closed segment."""
        done = [s for s in hyp.segments if s.complete]
        return int(round(done[-1].end_s * SAMPLE_RATE)) if done else hyp.start

    def _unread(self, hyp: _Hyp, pos: int, margin_s: float = 0.5) -> bool:
        """Speech (VAD) more than ``margin_s`` after the end of what ``hyp`` read and before ``pos``: Whisper stopped
        before the end of the audio (it can end a window early) or the speech started after its last segment."""
        if hyp.segments and not hyp.segments[-1].complete:
            return False  # an unfinished segment: it is reading on
        return self._speech(self._read_until(hyp) + int(margin_s * SAMPLE_RATE), pos)

    def _maybe_end_utterance(self, pos: int) -> None:
        """Everything committed, all speech read and the speaker paused: cut at the end of the last speech."""
        last = self._last_speech_end(self.buffer.start, pos)
        if last is not None and pos - last >= self.config.utterance_pause_s * SAMPLE_RATE and last > self.buffer.start:
            self._reset_buffer(last)

    def _drop_old_arrivals(self) -> None:
        keep = max(0, self.buffer.start - 60 * SAMPLE_RATE)
        while len(self._arrivals) > 1 and self._arrivals[0][0] < keep:
            self._arrivals.pop(0)


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
    decoded_until_s: float = 0.0
    skipped_positions: int = 0  # hop positions the passes skipped to catch up (``StreamConfig.catch_up_s``)

    @property
    def finals(self) -> list[Subtitle]:
        return [s for s in self.subtitles if s.kind == "final"]

    @property
    def text(self) -> str:
        return " ".join(s.text for s in self.finals if s.text)

    @property
    def warnings(self) -> list[StreamWarning]:
        return [s for s in self.subtitles if s.kind == "warning"]


def chunk_schedule(n_samples: int, chunk_s: float | Sequence[float] = 0.5, pace: float | None = 1.0,
                   pauses: dict[int, float] | None = None) -> list[tuple[int, int, float]]:
    """``(start, end, arrival s)`` of each chunk: chunk sizes ``chunk_s`` (a list cycles), sent at ``pace`` x real
    time (None: all at once, at time 0), with ``pauses[k]`` extra seconds before chunk ``k``."""
    sizes = [chunk_s] if isinstance(chunk_s, (int, float)) else list(chunk_s)
    out, i, t, k = [], 0, 0.0, 0
    while i < n_samples:
        n = max(1, int(round(sizes[k % len(sizes)] * SAMPLE_RATE)))
        j = min(n_samples, i + n)
        t += (pauses or {}).get(k, 0.0)
        if pace is not None:
            t += (j - i) / SAMPLE_RATE / pace
        out.append((i, j, t))
        i, k = j, k + 1
    return out


async def replay(service: SpeechService, audio: np.ndarray, chunk_s: float | Sequence[float] = 0.5,
                 config: StreamConfig | None = None, pace: float | None = 1.0,
                 pauses: dict[int, float] | None = None, clock: SimClock | None = None) -> ReplayResult:
    """Stream ``audio`` (16 kHz float32) through a recognizer on a simulated clock (:func:`chunk_schedule`:
    chunk ``k`` arrives when its last sample would at ``pace`` x real time; None: everything at once); passes take
    their real compute time on that clock; idle waits take none. So the latencies are those of a live stream on
    this machine (one stream, no other load), measured faster than real time. ``clock``: a :class:`SimClock` (or
    a subclass that charges passes another cost: tests)."""
    clock = clock or SimClock()
    rec = StreamingRecognizer(service, config, clock=clock)
    sched = chunk_schedule(len(audio), chunk_s, pace, pauses)
    subs: list[Subtitle] = []
    t_wall = time.perf_counter()
    k = 0
    while k < len(sched):
        while k < len(sched) and sched[k][2] <= clock.t + 1e-9:
            a, b, at = sched[k]
            rec.insert_audio(audio[a:b], arrived_at=at)
            k += 1
        if rec.ready():
            clock.begin()
            subs.extend(await rec.process())
            clock.end()
        elif k < len(sched):
            clock.t = max(clock.t, sched[k][2])
    clock.begin()
    subs.extend(await rec.finish())
    clock.end()
    return ReplayResult(subs, rec.passes, len(audio) / SAMPLE_RATE, time.perf_counter() - t_wall,
                        rec.decoded_until_s, rec.skipped_positions)


def replay_file(path: str, model=None, chunk_s: float = 0.5, config: StreamConfig | None = None,
                pace: float | None = 1.0) -> ReplayResult:
    """:func:`replay` of an audio file with a fresh :class:`SpeechService` (blocking)."""
    from specstream.modalities.audio import load_audio

    async def run():
        svc = SpeechService(model, num_slots=2)
        try:
            return await replay(svc, load_audio(path), chunk_s, config, pace)
        finally:
            await svc.stop()

    return asyncio.run(run())
