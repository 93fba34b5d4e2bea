"""Whisper's time mechanisms: timestamp tokens, segments, word times from cross-attention, subtitle cues.

- :class:`ApplyTimestampRules` — the decoding rules that make Whisper write ``<|t|> text <|t|>`` pairs (Radford et
  al. 2022, section 4.3; the rules of openai-whisper's ``ApplyTimestampRules`` and CTranslate2's Whisper
  ``ApplyTimestampRules``), as a per-row :class:`~specstream.stages.speculative.logits.LogitsProcessor`: each token
  tree node gets the scores plain decoding would give it, so speculative output stays identical to plain output.
- :func:`split_timestamped` — a window's tokens into segments and how far the window was consumed (the ``seek``
  advance of Whisper's sequential long-form transcription, as faster-whisper does it).
- :func:`find_alignment` + :func:`add_word_timestamps` — word times by dynamic time warping over the
  cross-attention weights of the alignment heads (openai-whisper's ``timing.py``, faster-whisper's
  ``find_alignment``/``add_word_timestamps``): median filter (width 7), per-token normalisation, DTW, one time per
  token jump, then the same clean-ups of over-long words at pauses and sentence ends.
- :func:`split_cues` — long segments split into subtitle cues under a maximum number of characters and a maximum
  duration (the limits subtitle style guides set: 42 characters per line, two lines, at most 7 s on screen).

Times are seconds. ``TIME_PRECISION`` (0.02 s) is the step of the timestamp tokens; the encoder produces
``TOKENS_PER_SECOND`` (50) frames per second of audio.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from specstream.stages.speculative.logits import History, LogitsProcessor
from specstream.types import Word  # noqa: F401  (the one word type; re-exported)

TIME_PRECISION = 0.02  # seconds per timestamp token step
TOKENS_PER_SECOND = 50  # encoder frames per second
INPUT_STRIDE = 2  # mel frames per encoder frame
MEDIAN_FILTER_WIDTH = 7
PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
NO_SPACE_LANGUAGES = ("zh", "ja", "th", "lo", "my", "yue")


class ApplyTimestampRules(LogitsProcessor):
    """Whisper's timestamp rules, per logits row (histories start with the prompt; ``begin_index`` is its length).

    1. ``<|notimestamps|>`` never.
    2. The first generated token is a timestamp, at most ``max_initial_timestamp_index`` steps (x 0.02 s) in.
    3. Timestamps come in pairs (end of a segment, start of the next) except directly before end-of-text: after a
       timestamp preceded by a timestamp (or at the start), text must follow; after a lone timestamp, a timestamp
       or end-of-text must follow (no text), and it may not be earlier.
    4. Timestamps never decrease (after text: strictly later than the last one).
    5. When the total probability of the timestamps exceeds that of the most likely text token, a timestamp is
       forced.

    All rows are handled by a few tensor operations on the scores' device, whatever their number (every node of
    every request's token tree in one call, :meth:`apply_rows`): the host reads each row's history once and
    writes, per row, two banned column ranges and whether rule 5 applies; one mask gathered from cached rows and
    a batched comparison for rule 5 do the rest. No Python loop writes into the tensor.
    """

    def __init__(self, eot: int, no_timestamps: int, timestamp_begin: int, begin_index: int,
                 max_initial_timestamp_index: int | None = 50):
        self.eot, self.no_timestamps, self.timestamp_begin = int(eot), int(no_timestamps), int(timestamp_begin)
        self.begin_index = int(begin_index)
        self.max_initial = None if max_initial_timestamp_index is None else int(max_initial_timestamp_index)

    def __call__(self, sequences, scores):
        return self.apply_rows([self] * len(sequences), sequences, scores)

    def _last_timestamp(self, gen: Sequence[int], memo: dict | None) -> int | None:
        """The last timestamp token of ``gen`` (the generated part of a history), or None.

        A :class:`~specstream.stages.speculative.logits.History` is scanned part by part from its end: the tree
        path (a few tokens), then the committed output, whose answer ``memo`` keeps for the call (every node of
        a request's tree shares that list), so the nodes of a tree cost one scan of the text since the last
        timestamp, not one each. Measured, the same run, the host part of the rules for 8 requests x 21 nodes:
        11.6 -> 1.1 ms per step with 50 text tokens since the last timestamp, 27.0 -> 1.1 ms with 200 (a scan
        through ``History.__getitem__`` for each node cost about 2 us per token and node)."""
        tb = self.timestamp_begin
        if not isinstance(gen, History) or memo is None:
            return next((int(t) for t in reversed(gen) if t >= tb), None)
        for part, lo, hi in reversed(gen.segments()):
            key = (id(part), lo, hi, tb)
            if key in memo:
                found = memo[key]
            else:
                found = next((int(part[i]) for i in range(hi - 1, lo - 1, -1) if part[i] >= tb), None)
                if hi - lo > 8:  # the shared lists (prompt, output); a path is cheaper to rescan than to key
                    memo[key] = found
            if found is not None:
                return found
        return None

    def _row_bounds(self, seq: Sequence[int], vocab: int,
                    memo: dict | None = None) -> tuple[int, int, int, int, int, int, int]:
        """``(lo1, hi1, lo2, hi2, check, no_timestamps, timestamp_begin)`` of one history: columns in
        ``[lo1, hi1)`` and ``[lo2, hi2)`` are banned; ``check``: rule 5 applies. ``memo``: shared by the rows
        of one :meth:`apply_rows` call (see :meth:`_last_timestamp`)."""
        tb = self.timestamp_begin
        gen = seq[self.begin_index:]
        if not len(gen):  # rule 2: a timestamp first, not later than the initial limit
            late = vocab if self.max_initial is None else min(vocab, tb + self.max_initial + 1)
            return 0, tb, late, vocab, 0, self.no_timestamps, tb
        last = int(gen[-1])
        if last >= tb:
            if len(gen) < 2 or int(gen[-2]) >= tb:  # a pair just closed (or the first token): text next
                return tb, vocab, 0, 0, 0, self.no_timestamps, tb
            # a segment just ended: its pair partner or end-of-text, not earlier
            return 0, self.eot, tb, last, 1, self.no_timestamps, tb
        last_ts = self._last_timestamp(gen, memo)  # rule 4: strictly later after text
        return (tb, last_ts + 1, 0, 0, 1, self.no_timestamps, tb) if last_ts is not None else (
            0, 0, 0, 0, 1, self.no_timestamps, tb)

    @staticmethod
    @functools.lru_cache(maxsize=512)
    def _banned(device: torch.device, vocab: int, lo1: int, hi1: int, lo2: int, hi2: int, nts: int) -> torch.Tensor:
        """The banned columns ``[V]`` bool of one row's bounds (:meth:`_row_bounds`), made once per distinct
        bounds and device. A request's rows repeat a few bounds for many steps (the last timestamp changes once
        per segment), so a step looks its masks up instead of comparing a 51,864-column range per row (nine passes
        over ``[N, V]`` int64; 0.19 ms of a 1.1-ms call at one row). 512 masks of
        Whisper's vocabulary hold 27 MB. Made outside inference mode, so that a mask first built inside it also
        serves a later call outside it."""
        with torch.inference_mode(False):
            col = torch.arange(vocab, device=device)
            return ((col >= lo1) & (col < hi1)) | ((col >= lo2) & (col < hi2)) | (col == nts)

    @classmethod
    def apply_rows(cls, processors, sequences, scores):
        """The rules of ``processors[i]`` on row ``i`` of ``scores`` ``[N, V]`` (in place), for any mix of
        requests (each its own prompt length): one ``[N, V]`` mask of cached rows (:meth:`_banned`), one fill,
        and rule 5 on the two slices of the scores.

        Rule 5 compares the timestamps' log-sum-exp with the best text score on the raw scores: both sides of
        ``logsumexp(log_softmax(s)[ts]) > max(log_softmax(s)[text])`` carry the same normaliser, so the full-row
        log-softmax (and a pass over ``[N, V]`` for the text mask) is not needed. The two forms are equal as
        mathematics; in float32 they can decide differently when the two sides lie within a few ulps of each
        other (the subtraction of the normaliser rounds), and a +inf timestamp score now forces a timestamp
        where the log-softmax form gave NaN and did not. Speculative and plain decoding use this one form, so
        their outputs stay identical. Measured at one row on one core of the AVX2-only AMD EPYC Zen 3 of
        ``docs/benchmarks.md`` (microbenchmark, read bandwidth not measured in it): the call took 1.14 ms before
        and 0.21 ms after."""
        n, vocab = scores.shape
        if n == 0:
            return scores
        dev, inf = scores.device, float("-inf")
        memo: dict = {}  # valid for this call only: the histories are views of lists that grow between steps
        host = [p._row_bounds(seq, vocab, memo) for p, seq in zip(processors, sequences)]
        masks = [cls._banned(dev, vocab, b[0], b[1], b[2], b[3], b[5]) for b in host]
        scores.masked_fill_(masks[0][None] if n == 1 else torch.stack(masks), inf)
        checks = [b[4] > 0 for b in host]
        if not any(checks):
            return scores
        # rule 5: the timestamps' total probability against the most likely text token
        tb0 = processors[0].timestamp_begin
        if all(p.timestamp_begin == tb0 for p in processors):
            force = scores[:, tb0:].logsumexp(-1) > scores[:, :tb0].amax(-1)  # [N]
            if not all(checks):
                force &= torch.tensor(checks, device=dev)
            scores[:, :tb0].masked_fill_(force[:, None], inf)
            return scores
        tbs = torch.tensor([b[6] for b in host], device=dev)[:, None]  # [N, 1]
        is_text = torch.arange(vocab, device=dev)[None, :] < tbs  # [N, V]
        ts_mass = scores.masked_fill(is_text, inf).logsumexp(-1)
        text_max = scores.masked_fill(~is_text, inf).amax(-1)
        force = (ts_mass > text_max) & torch.tensor(checks, device=dev)
        scores.masked_fill_(force[:, None] & is_text, inf)
        return scores


# -- segments -------------------------------------------------------------------------------------------------------
@dataclass
class WindowSegment:
    """One segment of a window: times in seconds from the start of the audio; ``tokens`` with its timestamps.

    ``complete``: closed by an end timestamp (Whisper judged it finished); the last segment of a window without one
    is still being spoken."""

    start_s: float
    end_s: float
    tokens: list[int]
    complete: bool = True
    words: list["Word"] | None = None

    def text_tokens(self, eot: int) -> list[int]:
        return [t for t in self.tokens if t < eot]


@dataclass(frozen=True)
class Split:
    """:func:`split_timestamped`'s result.

    Attributes:
        segments: the window's segments as Whisper's long-form emits them.
        consumed_frames: the seek advance in mel frames (how far the window was consumed).
        single_timestamp_ending: the tokens ended with a single timestamp (no speech after the last segment).
        tail: text after the last timestamp pair that long-form leaves for the next window (``complete=False``),
            or None.
    """

    segments: list[WindowSegment]
    consumed_frames: int
    single_timestamp_ending: bool
    tail: WindowSegment | None = None


def split_timestamped(tokens: Sequence[int], timestamp_begin: int, time_offset_s: float, segment_frames: int) -> Split:
    """Cut a window's generated tokens (end-of-text excluded) at consecutive timestamp pairs.

    As Whisper's sequential long-form does (faster-whisper ``_split_segments_by_timestamps``): with a pair
    ``<|a|><|b|>`` somewhere, each pair closes a segment; when the tokens end with a single timestamp, everything
    was transcribed and the whole window is consumed; otherwise the text after the last pair is an unfinished
    segment (:attr:`Split.tail`), left for the next window, which starts at the last timestamp. Without pairs the
    window is one segment ending at its last timestamp (or at the window's content end); it is ``complete`` only
    when its last token is a timestamp.

    Args:
        tokens: generated tokens, timestamps included.
        time_offset_s: the window's start in the audio.
        segment_frames: mel frames of content in the window (100 per second).
    """
    toks = [int(t) for t in tokens]
    tb = timestamp_begin
    single_end = len(toks) >= 2 and toks[-2] < tb <= toks[-1]
    pairs = [i for i in range(1, len(toks)) if toks[i] >= tb and toks[i - 1] >= tb]
    segments: list[WindowSegment] = []
    tail = None
    if pairs:
        cuts = pairs + ([len(toks)] if single_end else [])
        last = 0
        for cut in cuts:
            part = toks[last:cut]
            segments.append(WindowSegment(round(time_offset_s + (part[0] - tb) * TIME_PRECISION, 3),
                                          round(time_offset_s + (part[-1] - tb) * TIME_PRECISION, 3), part))
            last = cut
        if single_end:
            consumed = segment_frames
        else:
            consumed = (toks[last - 1] - tb) * INPUT_STRIDE
            rest = toks[last:]
            if rest:
                start = rest[0] - tb if rest[0] >= tb else toks[last - 1] - tb
                tail = WindowSegment(round(time_offset_s + start * TIME_PRECISION, 3),
                                     round(time_offset_s + segment_frames / 100.0, 3), rest, False)
    else:
        stamps = [t for t in toks if t >= tb]
        duration = segment_frames / 100.0
        if stamps and stamps[-1] != tb:
            duration = (stamps[-1] - tb) * TIME_PRECISION
        start = (stamps[0] - tb) * TIME_PRECISION if stamps and toks and toks[0] >= tb else 0.0
        if toks:
            segments.append(WindowSegment(round(time_offset_s + start, 3), round(time_offset_s + duration, 3), toks,
                                          len(toks) > 1 and toks[-1] >= tb))
        consumed = segment_frames
    return Split(segments, int(consumed), single_end, tail)


# -- word alignment -------------------------------------------------------------------------------------------------
@dataclass
class WordTiming:
    word: str
    tokens: list[int]
    start: float
    end: float
    probability: float


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over the last axis in windows of odd ``width``, edges mirrored (not repeated) as openai-whisper's
    ``median_filter`` does. ``x`` ``[..., T]`` with ``T > width // 2``."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    shape = x.shape
    y = torch.nn.functional.pad(x.reshape(-1, 1, shape[-1]), (pad, pad), mode="reflect")
    return y.unfold(-1, width, 1).median(-1).values.reshape(shape)


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dynamic time warping path through ``cost`` ``[N, M]`` (lower is better) from ``(0, 0)`` to ``(N-1, M-1)``.

    Each cell extends its cheapest predecessor (diagonal first, then up, then left on ties), as openai-whisper's
    ``dtw_cpu``; the recurrence is evaluated along anti-diagonals so each step is one numpy operation.

    Returns:
        ``(text_indices, time_indices)`` of the path, in order.
    """
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf, dtype=np.float64)
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    acc[0, 0] = 0.0
    for d in range(2, n + m + 1):  # cells (i, j), i + j == d, 1 <= i <= n, 1 <= j <= m
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        c0, c1, c2 = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
        t = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        acc[i, j] = cost[i - 1, j - 1] + np.choose(t, [c0, c1, c2])
        trace[i, j] = t
    trace[0, :] = 2
    trace[:, 0] = 1
    i, j = n, m
    path = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        t = trace[i, j]
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        else:
            j -= 1
    path.reverse()
    arr = np.array(path, dtype=np.int64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


def split_words(tokens: Sequence[int], decode: Callable[[list[int]], str], eot: int,
                language: str | None) -> tuple[list[str], list[list[int]]]:
    """Group tokens into words: whole unicode characters first; for languages written with spaces a new word
    starts at a leading space, at punctuation and at a special token (openai-whisper ``split_to_word_tokens``)."""
    subwords: list[str] = []
    groups: list[list[int]] = []
    current: list[int] = []
    full = decode(list(tokens))
    pos = 0
    for t in tokens:
        current.append(t)
        piece = decode(current)
        if "\ufffd" not in piece or full[pos:pos + len(piece)] == piece:
            subwords.append(piece)
            groups.append(current)
            current = []
            pos += len(piece)
    if language in NO_SPACE_LANGUAGES:
        return subwords, groups
    words: list[str] = []
    word_tokens: list[list[int]] = []
    for sub, toks in zip(subwords, groups):
        new = toks[0] >= eot or sub.startswith(" ") or sub.strip() in string.punctuation or not words
        if new:
            words.append(sub)
            word_tokens.append(list(toks))
        else:
            words[-1] += sub
            word_tokens[-1].extend(toks)
    return words, word_tokens


def find_alignment(scores: torch.Tensor, text_tokens: Sequence[int], token_probs: Sequence[float], num_frames: int,
                   decode: Callable[[list[int]], str], eot: int, language: str | None) -> list[WordTiming]:
    """Word times (seconds from the window start) by DTW over alignment-head cross-attention.

    Args:
        scores: pre-softmax cross-attention scores of the alignment heads ``[heads, T, S_enc]`` for the input
            ``sot_sequence + <|notimestamps|> + text_tokens + <|endoftext|>``; rows from the one that predicts the
            first text token (``<|notimestamps|>``) through the last text token, i.e. ``len(text_tokens) + 1`` rows.
        token_probs: the decoder's probability of each text token in that forward (text vocabulary softmax).
        num_frames: mel frames of audio in the window (the attention is cut to ``num_frames // 2`` encoder frames).
    """
    if not len(text_tokens):
        return []
    w = scores[:, :, : max(1, num_frames // INPUT_STRIDE)].float().softmax(-1)
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
    w = (w - mean) / std
    w = median_filter(w, MEDIAN_FILTER_WIDTH)
    matrix = w.mean(0).cpu().double().numpy()  # [len(text) + 1, frames]
    text_idx, time_idx = dtw(-matrix)
    words, word_tokens = split_words(list(text_tokens) + [eot], decode, eot, language)
    if len(word_tokens) <= 1:
        return []
    bounds = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
    jumps = np.pad(np.diff(text_idx), (1, 0), constant_values=1).astype(bool)
    jump_times = time_idx[jumps] / TOKENS_PER_SECOND
    starts = jump_times[bounds[:-1]]
    ends = jump_times[bounds[1:]]
    probs = list(token_probs)
    out = []
    for k, (word, toks, s, e) in enumerate(zip(words[:-1], word_tokens[:-1], starts, ends)):
        p = probs[bounds[k]:bounds[k + 1]]
        out.append(WordTiming(word, list(toks), float(s), float(e), float(np.mean(p)) if p else 0.0))
    return out


def merge_punctuations(alignment: list[WordTiming], prepended: str = PREPEND_PUNCTUATIONS,
                       appended: str = APPEND_PUNCTUATIONS) -> None:
    """Attach leading punctuation to the next word and trailing punctuation to the previous one (in place; the
    emptied entries keep their tokens, so token counts still add up)."""
    i = len(alignment) - 2
    j = len(alignment) - 1
    while i >= 0:
        prev, following = alignment[i], alignment[j]
        if prev.word.startswith(" ") and prev.word.strip() in prepended:
            following.word = prev.word + following.word
            following.tokens = prev.tokens + following.tokens
            prev.word, prev.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(alignment):
        prev, following = alignment[i], alignment[j]
        if not prev.word.endswith(" ") and following.word in appended:
            prev.word = prev.word + following.word
            prev.tokens = prev.tokens + following.tokens
            following.word, following.tokens = "", []
        else:
            i = j
        j += 1


def add_word_timestamps(segments: list[WindowSegment], alignment: list[WordTiming], time_offset_s: float,
                        eot: int, last_speech_s: float) -> float:
    """Give each segment of one window its words (``segment.words``) and snap the segment's times to them.

    The clean-ups follow openai-whisper / faster-whisper: words much longer than the median (0.7 s at most) are cut
    at sentence ends and after pauses; a segment's timestamp is preferred over its first / last word when that word
    is far too long. Returns the end of the last word (the new ``last_speech_s``)."""
    durations = np.array([w.end - w.start for w in alignment])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    longest = median * 2
    if len(durations):
        marks = ".。!！?？"
        for i in range(1, len(alignment)):
            if alignment[i].end - alignment[i].start > longest:
                if alignment[i].word in marks:
                    alignment[i].end = alignment[i].start + longest
                elif alignment[i - 1].word in marks:
                    alignment[i].start = alignment[i].end - longest
    merge_punctuations(alignment)
    k = 0
    for seg in segments:
        n_tokens = len(seg.text_tokens(eot))
        taken = 0
        words: list[dict] = []
        while k < len(alignment) and taken < n_tokens:
            a = alignment[k]
            if a.word:
                words.append({"word": a.word, "start": round(time_offset_s + a.start, 2),
                              "end": round(time_offset_s + a.end, 2), "probability": a.probability})
            taken += len(a.tokens)
            k += 1
        if words:
            first, last = words[0], words[-1]
            if first["end"] - last_speech_s > median * 4 and (
                    first["end"] - first["start"] > longest
                    or (len(words) > 1 and words[1]["end"] - first["start"] > longest * 2)):
                if len(words) > 1 and words[1]["end"] - words[1]["start"] > longest:
                    edge = max(words[1]["end"] / 2, words[1]["end"] - longest)
                    first["end"] = words[1]["start"] = edge
                first["start"] = max(0.0, first["end"] - longest)
            if seg.start_s < first["end"] and seg.start_s - 0.5 > first["start"]:
                first["start"] = max(0.0, min(first["end"] - median, seg.start_s))
            else:
                seg.start_s = first["start"]
            if seg.end_s > last["start"] and seg.end_s + 0.5 < last["end"]:
                last["end"] = max(last["start"] + median, seg.end_s)
            else:
                seg.end_s = last["end"]
            last_speech_s = seg.end_s
        seg.words = [Word(w["start"], w["end"], w["word"], round(w["probability"], 4)) for w in words]
    return last_speech_s


# -- subtitle cues --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CueLimits:
    """How long one subtitle cue may be.

    Attributes:
        max_chars: characters of text per cue (two lines of 42, the common subtitle guideline).
        max_duration_s: seconds on screen per cue (style guides allow about 7 s).
    """

    max_chars: int = 84
    max_duration_s: float = 7.0

    def __post_init__(self):
        if self.max_chars < 1 or not self.max_duration_s > 0:
            raise ValueError(f"cue limits must be positive, got {self}")


@dataclass(frozen=True)
class Cue:
    start_s: float
    end_s: float
    text: str
    words: tuple[Word, ...] = field(default=())


def split_cues(start_s: float, end_s: float, text: str, words: Sequence[Word] | None, limits: CueLimits) -> list[Cue]:
    """Split one segment into cues of at most ``limits.max_chars`` characters and ``limits.max_duration_s``.

    Cuts fall between words, preferring the latest sentence end, then the latest comma, inside the allowed span.
    With word times (``words``) a cue's times are those of its first and last word; without, times are shared
    out in proportion to the characters (an estimate). A single word longer than the limits stays one cue."""
    text = text.strip()
    if not text:
        return []
    if words:
        units = [(w.word, w.start_s, w.end_s) for w in words if w.word.strip()]
    else:
        toks = text.split(" ")
        total = max(1, len(text))
        units, pos = [], 0
        for i, tok in enumerate(toks):
            piece = tok if i == 0 else " " + tok
            a = start_s + (end_s - start_s) * pos / total
            pos += len(piece)
            units.append((piece, a, start_s + (end_s - start_s) * pos / total))
    if not units:
        return []
    fits = len(text) <= limits.max_chars and end_s - start_s <= limits.max_duration_s + 1e-9
    if fits:
        return [Cue(start_s, end_s, text, tuple(words or ()))]
    cues: list[Cue] = []
    i = 0
    while i < len(units):
        j = i + 1  # exclusive end of the longest run that fits
        while j < len(units):
            chars = len("".join(u[0] for u in units[i:j + 1]).strip())
            if chars > limits.max_chars or units[j][2] - units[i][1] > limits.max_duration_s:
                break
            j += 1
        if j < len(units):  # prefer a sentence end, then a comma, in the later half of the run
            for marks in (".!?。！？", ",;:，、"):
                best = next((k for k in range(j, i + max(1, (j - i) // 2), -1)
                             if units[k - 1][0].rstrip().endswith(tuple(marks))), None)
                if best is not None:
                    j = best
                    break
        run = units[i:j]
        cue_words = tuple(w for w in (words or ()) if run[0][1] - 1e-9 <= w.start_s and w.end_s <= run[-1][2] + 1e-9)
        cues.append(Cue(round(run[0][1], 3), round(run[-1][2], 3), "".join(u[0] for u in run).strip(),
                        cue_words if words else ()))
        i = j
    if not words:  # proportional times: the first and last cue keep the segment's bounds exactly
        cues[0] = replace(cues[0], start_s=start_s)
        cues[-1] = replace(cues[-1], end_s=end_s)
    return cues
