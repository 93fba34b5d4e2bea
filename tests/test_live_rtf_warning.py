"""A live stream that cannot keep up says so (issue 19, item 3): when a decoding pass takes longer than the audio
between passes, the session gets one ``warning`` event naming the measured real-time factor, as soon as it is
measured; a later stream of the same service gets it on its first pass. A stream that keeps up gets none.

The slow machine is made deterministic: the replay's clock counts simulated time only, and each window decode
of the real service costs a fixed time on it (0.25 s: keeps up; 2.5 s: does not)."""

from __future__ import annotations

import asyncio

import pytest

from live_fixtures import SCRIPT, compose
from whisper_fixtures import one_torch_thread, speech_cache  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(300)


class SimTimeOnly:
    """A replay clock on simulated time alone (the real compute time of a pass is not charged)."""

    def __new__(cls):
        from specstream.stages.streaming import SimClock

        class Clock(SimClock):
            def __call__(self) -> float:
                return self.t

        return Clock()


def _slow_service(clock, pass_s: float):
    """The real service on a device that takes ``pass_s`` seconds of ``clock`` per window decode."""
    from specstream.stages.streaming import SpeechService

    class Slow(SpeechService):
        async def decode_window(self, *args, **kwargs):
            dec = await super().decode_window(*args, **kwargs)
            clock.t += pass_s
            return dec

    return Slow(None, num_slots=2)


def test_slow_passes_send_one_warning_with_the_measured_rtf(speech_cache, tmp_path):
    from specstream.stages.streaming import RTF_PASSES, SpeechService, StreamConfig, replay

    rec = compose(tmp_path, SCRIPT[:1], [0.2], lead_s=0.3, name="rtf")
    cfg = StreamConfig(hop_s=1.0, catch_up_s=None)  # a pass at every position (the catch-up: test_live_catch_up)
    clock = SimTimeOnly()
    svc = _slow_service(clock, 0.25)  # keeps up: 0.25 s per 1-s hop
    fast = asyncio.run(replay(svc, rec.audio, 0.5, cfg, pace=1.0, clock=clock))
    assert fast.warnings == [] and fast.finals and svc.pass_s == pytest.approx(0.25)

    clock = SimTimeOnly()
    svc = _slow_service(clock, 2.5)  # a fresh service on a slow device: nothing measured before this stream
    slow = asyncio.run(replay(svc, rec.audio, 0.5, cfg, pace=1.0, clock=clock))
    (w,) = slow.warnings
    assert (w.code, w.rtf, w.pass_s, w.hop_s) == ("falling_behind", 2.5, 2.5, 1.0)
    msg = w.message()
    assert msg["type"] == "warning" and msg["rtf"] == 2.5 and "2.50" in msg["message"]
    assert len(slow.passes) > RTF_PASSES  # sent as soon as measured, while the stream goes on
    assert slow.subtitles.index(w) < len(slow.subtitles) - 1
    assert [f.text for f in slow.finals] == [f.text for f in fast.finals]  # the text does not change

    again = asyncio.run(replay(svc, rec.audio, 0.5, cfg, pace=1.0, clock=clock))
    assert again.subtitles[0].kind == "warning" and again.subtitles[0].rtf == pytest.approx(2.5)
    assert len(again.warnings) == 1  # on start, from the service's measurement, and only once
