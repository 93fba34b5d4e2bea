"""Live subtitles lose no speech, at any pace (reports 1, 2 and 6): passes run at fixed audio positions, so the
finals depend on the audio and not on how fast it arrives or whether drafts are on; a recording sent all at once
reads as well as the offline transcript; every second of speech ends up inside some final. Replays run on the
virtual clock of :func:`~specstream.stages.streaming.replay` (passes take their compute time; waits take none)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from live_fixtures import SCRIPT, compose, uncovered_speech, wer
from whisper_fixtures import one_torch_thread, speech_cache  # noqa: F401  (fixtures)

# Not ``exclusive`` (tests/conftest.py `_module_lock`): every replay here runs on the virtual clock, passes run at
# fixed audio positions and the deadline counts samples, so the finals do not depend on how fast this machine
# decodes (the first test checks exactly that, at three paces); it may run beside another module.


@pytest.fixture(scope="module")
def service(speech_cache):
    from specstream.stages.streaming import SpeechService

    return SpeechService(None, num_slots=2)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    return compose(tmp_path_factory.mktemp("three"), SCRIPT[:3], [1.2, 0.2, 0.6], lead_s=0.4)


@pytest.fixture(scope="module")
def espeak_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("espeak")


def _replay(service, audio, config, chunk_s=0.5, pace=1.0, pauses=None):
    from specstream.stages.streaming import replay

    async def run():
        try:
            if pace == 1.0 and pauses is None and isinstance(chunk_s, float):
                return await replay(service, audio, chunk_s, config)  # (the oldest replay's signature)
            return await replay(service, audio, chunk_s, config, pace=pace, pauses=pauses)
        finally:
            await service.stop()

    return asyncio.run(run())


def _finals(res):
    return [(f.text, f.start_s, f.end_s) for f in res.finals]


def test_same_finals_at_any_pace_with_and_without_drafts(service, three):
    """Report 2 / 1: the same recording at real-time pace in 0.37-s chunks, at 4x pace in ragged chunks with drafts
    off, and all at once: identical finals (text and times), with passes at every fixed position
    (``catch_up_s=None``; the catch-up of a stream that falls behind moves them: test_live_catch_up). Drafts cut
    the target decoder steps."""
    from specstream.stages.streaming import StreamConfig

    cfg = StreamConfig(hop_s=1.0, catch_up_s=None)
    slow = _replay(service, three.audio, cfg, chunk_s=0.37, pace=1.0)
    fast = _replay(service, three.audio, StreamConfig(hop_s=1.0, speculate=False, catch_up_s=None),
                   chunk_s=[0.2, 1.3, 0.05], pace=4.0)
    burst = _replay(service, three.audio, cfg, chunk_s=0.5, pace=None)
    assert _finals(slow) == _finals(fast) == _finals(burst)
    assert [p.audio_end_s for p in slow.passes] == [p.audio_end_s for p in fast.passes]
    assert slow.decoded_until_s == pytest.approx(three.duration_s)
    assert wer(three.text, slow.text) <= 0.45, slow.text
    assert not uncovered_speech(three.spans, [(s, e) for _, s, e in _finals(slow)]), _finals(slow)
    drafted = sum(p.target_steps for p in slow.passes)
    plain = sum(p.target_steps for p in fast.passes)
    print(f"\ntarget steps: {drafted} drafted, {plain} undrafted; {_finals(slow)}")
    assert drafted < 0.8 * plain


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(order=st.permutations(list(range(6))).map(lambda p: p[:3]),
       gaps=st.lists(st.sampled_from([0.1, 0.3, 0.7, 1.5, 2.5]), min_size=3, max_size=3),
       lead=st.sampled_from([0.0, 0.6]),
       chunks=st.lists(st.floats(0.02, 1.5), min_size=1, max_size=4),
       pause_at=st.integers(0, 8), pause=st.sampled_from([0.0, 3.0, 20.0]),
       pace=st.sampled_from([None, 1.0, 3.0]))
def test_every_second_of_speech_reaches_a_final(service, espeak_dir, order, gaps, lead, chunks, pause_at, pause,
                                                pace):
    """Property: random sentences joined with random pauses (up to ~10 s), sent in random chunk sizes with a
    random client pause, at 1x, 3x or all at once: every second of speech falls inside some final's span (0.5 s
    tolerance: segment times are Whisper's timestamps, 20-ms steps, usually within 0.1-0.3 s of the speech), the
    finals are ordered and inside the audio, and every sample was decoded."""
    from specstream.stages.streaming import StreamConfig

    short = [s for s in SCRIPT if len(s) < 50]
    rec = compose(espeak_dir, [short[i] for i in order], gaps, lead_s=lead, name="prop")
    res = _replay(service, rec.audio, StreamConfig(hop_s=2.0), chunk_s=chunks, pace=pace, pauses={pause_at: pause})
    finals = [(f.start_s, f.end_s) for f in res.finals]
    assert not uncovered_speech(rec.spans, finals), (rec.spans, _finals(res))
    last = 0.0
    for s, e in finals:
        assert last - 1e-6 <= s <= e <= rec.duration_s + 1e-6
        last = e
    assert res.decoded_until_s == pytest.approx(rec.duration_s)
    assert wer(rec.text, res.text) <= 0.6, (rec.text, res.text)


def test_finals_arrive_during_continuous_speech_at_the_default(service, espeak_dir):
    """Report 6: four sentences of continuous speech (0.15-s pauses) at real-time pace with the server's defaults:
    finals arrive while the speaker talks, at most 3 s of audio apart (measured at the position of the pass that
    committed each final, which no machine speed changes), and the whole text comes out."""
    from specstream.pipeline.server import ServerSettings
    from specstream.stages.streaming import StreamConfig

    s = ServerSettings()
    field = "hop_s" if "hop_s" in StreamConfig.__dataclass_fields__ else "min_hop_s"
    cfg = StreamConfig(**{field: s.min_hop_s}, agree_span_s=s.agree_span_s)
    rec = compose(espeak_dir, SCRIPT[:4], [0.15] * 4, name="continuous")
    res = _replay(service, rec.audio, cfg, pace=1.0)
    onset, speech_end = rec.spans[0][0], rec.spans[-1][1]
    during = [f.position_s for f in res.finals if f.position_s < speech_end] if res.finals and hasattr(
        res.finals[0], "position_s") else [f.emitted_s for f in res.finals if f.emitted_s < speech_end]
    gaps = np.diff([onset] + during)
    print(f"\nfinals at {during} (speech {onset:.2f}-{speech_end:.2f} s)")
    assert len(during) >= 3 and max(gaps) <= 3.0, (during, _finals(res))
    assert not uncovered_speech(rec.spans, [(f.start_s, f.end_s) for f in res.finals])


def test_buffer_at_the_bound_commits_instead_of_dropping(service, tmp_path):
    """Hypotheses that never settle are committed at ``max_buffer_s``, never discarded: with an agreement span
    longer than the recording and no deadline, only the buffer bound and the end of the stream commit, and all
    sentences still come out (report 1: a 30-s window emptied, 30.5-40 s never decoded). Forced commits take
    readings of short windows, so words are misread (tiny.en can read a 10-s window ending mid-sentence as one
    short invented sentence), but every sentence's audio is inside some final with text."""

    from specstream.stages.streaming import StreamConfig

    rec = compose(tmp_path, SCRIPT[:8], [0.3] * 8, name="bound")
    cfg = StreamConfig(hop_s=2.0, agree_span_s=60.0, max_final_gap_s=60.0, trim_after_s=8.0, keep_s=4.0,
                       max_buffer_s=10.0)
    res = _replay(service, rec.audio, cfg, pace=None)
    assert rec.duration_s > 25 and len(res.finals) >= 3
    assert not uncovered_speech(rec.spans, [(f.start_s, f.end_s) for f in res.finals]), _finals(res)
    assert max(p.audio_end_s - p.audio_start_s for p in res.passes) <= 10.0 + 2.0 + 1e-6
    for a, b in rec.spans:
        assert any(f.text and f.start_s < b and f.end_s > a for f in res.finals), ((a, b), _finals(res))
    assert wer(rec.text, res.text) <= 0.6, res.text


def test_ring_buffer_grows_instead_of_dropping():
    from specstream.stages.streaming import RingBuffer

    rb = RingBuffer(10)
    rb.append(np.arange(8, dtype=np.float32))
    rb.trim(5)
    rb.append(np.arange(8, 15, dtype=np.float32))
    assert rb.view().tolist() == list(range(5, 15)) and (rb.start, rb.end) == (5, 15) and rb.capacity == 10
    rb.append(np.arange(15, 40, dtype=np.float32))  # more than fits: the buffer grows, nothing is lost
    assert rb.view().tolist() == list(range(5, 40)) and rb.capacity == 40
    assert rb.view(12, 14).tolist() == [12, 13]


def test_non_finite_samples_are_refused(service):
    from specstream.stages.streaming import StreamingRecognizer

    rec = StreamingRecognizer(service)
    x = np.zeros(800, np.float32)
    x[10] = np.nan
    with pytest.raises(ValueError, match="finite"):
        rec.insert_audio(x)
    assert rec.audio_end_s == 0.0
