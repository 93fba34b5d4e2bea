"""Silero VAD as streamed by :class:`specstream.stages.vad.StreamingVad`: each frame's probability equals a plain
frame-by-frame run of the ONNX model (its 64-sample context taken from the audio before it), whatever the chunk
sizes the stream arrives in, and the speech flags follow the spoken spans of an espeak-ng recording."""

from __future__ import annotations

import numpy as np
import pytest

from live_fixtures import compose
from specstream.stages.vad import CONTEXT, FRAME, SAMPLE_RATE, SEQUENCE_BLOCK, StreamingVad, _session


@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    return compose(tmp_path_factory.mktemp("vad"), ["Please call Stella.", "We will meet at nine."], [1.5, 1.0],
                   lead_s=1.0)


def _frame_by_frame(audio: np.ndarray) -> list[float]:
    """The model's probabilities, one frame at a time, as Silero's own loop feeds it."""
    sess, state = _session(), np.zeros((2, 1, 128), np.float32)
    context, probs = np.zeros((1, CONTEXT), np.float32), []
    for i in range(len(audio) // FRAME):
        x = np.concatenate([context, audio[None, i * FRAME:(i + 1) * FRAME]], axis=1)
        out, state = sess.run(None, {"input": x, "state": state, "sr": np.array(SAMPLE_RATE, np.int64)})
        context = x[:, -CONTEXT:]
        probs.append(float(out.reshape(-1)[0]))
    return probs


def test_probabilities_equal_the_models_own_loop_for_any_chunk_size(rec):
    want = _frame_by_frame(rec.audio)
    for chunk in (len(rec.audio), 160, 1234, FRAME):
        vad = StreamingVad()
        for i in range(0, len(rec.audio), chunk):
            vad.accept(rec.audio[i:i + chunk])
        assert vad.frames == len(rec.audio) // FRAME
        assert np.array_equal(np.float32(vad.probs), np.float32(want)), chunk


def test_long_chunks_run_in_blocks_with_the_same_probabilities(rec, monkeypatch):
    """A chunk of more than one block of frames (speech, then noise, then speech again, 22 s, 702 frames) is read
    in ``ceil(frames / SEQUENCE_BLOCK)`` model calls, not one call per frame (where the installed silero-vad ships
    the sequence model; else one per frame), and its probabilities equal the frame-by-frame loop's across the
    block boundary. The stream then goes on one frame per chunk (the per-frame model, from the state the blocks
    carried out) and still equals the loop."""
    import onnxruntime

    from specstream.stages.vad import _sequence_session

    rng = np.random.default_rng(0)
    noise = (0.02 * rng.standard_normal(3 * SAMPLE_RATE)).astype(np.float32)
    audio = np.concatenate([rec.audio, noise, rec.audio, rec.audio])
    n = len(audio) // FRAME
    assert n > SEQUENCE_BLOCK
    calls = []
    run = onnxruntime.InferenceSession.run

    def counted(self, *args, **kwargs):
        calls.append(1)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(onnxruntime.InferenceSession, "run", counted)
    vad = StreamingVad()
    vad.accept(audio)
    monkeypatch.setattr(onnxruntime.InferenceSession, "run", run)
    assert len(calls) == (-(-n // SEQUENCE_BLOCK) if _sequence_session() is not None else n)
    tail = rec.audio[:FRAME * 40]
    rest = len(audio) - n * FRAME  # samples still pending in the VAD
    first = FRAME - rest
    vad.accept(tail[:first])  # completes the pending frame: one frame, the per-frame model
    for i in range(first, len(tail) - FRAME + 1, FRAME):
        vad.accept(tail[i:i + FRAME])
    want = _frame_by_frame(np.concatenate([audio, tail]))
    assert vad.frames == len(want) > n + 30
    assert np.array_equal(np.float32(vad.probs), np.float32(want))


def test_speech_flags_follow_the_spoken_spans(rec):
    vad = StreamingVad()
    vad.accept(rec.audio)
    for start, end in rec.spans:
        assert vad.has_speech(start, end)
        middle = (start + end) / 2
        assert vad.speech[int(middle * SAMPLE_RATE) // FRAME]
    assert not vad.has_speech(0.0, rec.spans[0][0] - 0.1)  # the leading digital silence (RMS floor)
    gap_end = rec.spans[1][0]
    assert vad.speech_offsets(rec.spans[0][0], gap_end)  # the first sentence's region ended in the pause
    assert vad.last_speech_end_s() == pytest.approx(rec.spans[1][1], abs=0.5)
