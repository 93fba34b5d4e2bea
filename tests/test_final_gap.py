"""``max_final_gap_s`` is a guarantee (issue 19, item 2): during continuous speech two finals are at most that much
audio apart, even when consecutive passes never agree. Then the deadline commits the most recent pass's words up
to its position, at word boundaries from the word timestamps, and committed text stays immutable (every later
hypothesis starts with it: LocalAgreement's rule).

Passes that never agree: the real tiny.en decodes every window, and each pass's new text (after the committed
prefix) starts with a word of its own (" one" on even passes, " two" on odd ones), so no two consecutive passes
share a first uncommitted token. Before the fix nothing was committed until the buffer bound (28 s) or the end."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from live_fixtures import SCRIPT, compose
from whisper_fixtures import one_torch_thread, speech_cache  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    return compose(tmp_path_factory.mktemp("gap"), SCRIPT[:2], [0.15, 0.15], name="never-agree")


def _never_agreeing_service(clock=None, pass_s: float = 0.0):
    """``clock``/``pass_s``: each window decode also costs ``pass_s`` seconds of that simulated clock."""
    from specstream.stages.streaming import SpeechService

    class NeverAgreeing(SpeechService):
        """The real service; each pass's new text is led by a word that differs from the previous pass's."""

        passes = 0

        async def decode_window(self, window, hypothesis=None, *args, prefix=(), **kwargs):
            dec = await super().decode_window(window, None, *args, prefix=prefix, **kwargs)
            tb = self.model.tokens.timestamp_begin
            words = [[t for t in self.model.tokenizer.encode(w).ids if t < self.model.tokens.eot]
                     for w in (" one", " two")]
            toks = list(dec.tokens)
            i = 0
            while i < len(toks) and toks[i] >= tb:  # after a leading timestamp
                i += 1
            lead = words[NeverAgreeing.passes % 2]
            NeverAgreeing.passes += 1
            if clock is not None:
                clock.t += pass_s
            return dataclasses.replace(dec, tokens=tuple(toks[:i] + lead + toks[i:]))

    return NeverAgreeing(None, num_slots=2)


@pytest.mark.parametrize("device", ["every position", "catching up"])
def test_finals_never_stall_when_passes_never_agree(speech_cache, recording, device):
    """With a pass at every hop position (``catch_up_s=None``, the default), and on a simulated device 3x slower
    than real time whose passes skip positions to catch up with the clock (``catch_up_s=1``)."""
    from test_live_rtf_warning import SimTimeOnly

    from specstream.stages.streaming import StreamConfig, replay

    if device == "every position":
        svc, clock, pace = _never_agreeing_service(), None, None
        cfg = StreamConfig(hop_s=0.5, catch_up_s=None)
    else:
        clock = SimTimeOnly()
        svc, pace = _never_agreeing_service(clock, 1.5), 1.0
        cfg = StreamConfig(hop_s=0.5, catch_up_s=1.0)
    assert cfg.max_final_gap_s == 3.0
    res = asyncio.run(replay(svc, recording.audio, 0.5, cfg, pace=pace, clock=clock))
    if device == "catching up":
        ends = [p.audio_end_s for p in res.passes]
        assert max(b - a for a, b in zip(ends, ends[1:])) > 0.5 + 1e-6, ends  # positions were skipped
    onset, speech_end = recording.spans[0][0], recording.spans[-1][1]
    during = [f.position_s for f in res.finals if f.position_s <= speech_end]
    gaps = np.diff([onset] + during)
    print(f"\nfinals at {during}; texts {[f.text for f in res.finals]}")
    assert len(during) >= 2 and max(gaps) <= cfg.max_final_gap_s + 1e-6, (during, [f.text for f in res.finals])
    for p in res.passes:  # committed text is immutable: every hypothesis starts with the committed prefix
        assert p.tokens[:len(p.prefix)] == p.prefix
    assert all(f.text for f in res.finals)
    assert "one" in res.text or "two" in res.text  # the most recent pass's words were committed
    last = 0.0
    for f in res.finals:
        assert last - 1e-6 <= f.start_s <= f.end_s <= recording.duration_s + 1e-6
        last = f.end_s


def test_gap_setting_is_checked():
    from specstream.stages.streaming import StreamConfig

    with pytest.raises(ValueError, match="max_final_gap_s"):
        StreamConfig(hop_s=1.0, max_final_gap_s=0.0)
    # a gap below the span + two hops is raised to that floor, not refused: a long hop (one pass over a whole
    # recording) keeps the default gap
    long_hop = StreamConfig(hop_s=15.0, trim_after_s=15.0, max_buffer_s=15.0)
    assert long_hop.max_final_gap_s == 3.0
