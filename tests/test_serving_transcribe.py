"""``ModelHub.transcribe`` calls the speech path with explicit arguments (issue 20's review): a prompt, which the
speech path cannot take, is refused before any model loads."""

from __future__ import annotations

import asyncio
import wave

import numpy as np
import pytest

from specstream.errors import UnsupportedParameterError
from specstream.stages.serving import HubConfig, ModelHub


def _wav(path):
    t = np.arange(16000) / 16000.0
    pcm = (0.3 * np.sin(2 * np.pi * 440.0 * t) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return path


def test_a_prompt_is_refused_before_the_speech_model_loads(tmp_path):
    hub = ModelHub(HubConfig(speech_model=str(tmp_path / "no-such-whisper")))  # loading it would fail otherwise

    async def run():
        try:
            with pytest.raises(UnsupportedParameterError, match="param 'prompt'"):
                await hub.transcribe(_wav(tmp_path / "tone.wav"), prompt="Names: Ada, Grace.")
        finally:
            await hub.stop()

    asyncio.run(run())
    assert hub._speech is None


def test_segments_carry_the_speech_paths_words_as_made():
    """One word type (``specstream.types.Word``): the speech path's words reach the hub's segments unchanged,
    their probability included (was: copied into a second word type, chosen by ``hasattr``, without it)."""
    from specstream.stages import serving, speech, whisper_timing
    from specstream.types import Word

    assert whisper_timing.Word is Word and serving.Word is Word
    words = (Word(0.0, 0.4, " Ada", 0.91), Word(0.5, 0.9, " spoke.", 0.87))
    seg = serving._transcript_segment(speech.Segment(0.0, 0.9, " Ada spoke.", (1, 2), words, -0.2, 0.01))
    assert seg.words == words and seg.words[0].probability == 0.91
    assert (seg.start_s, seg.end_s, seg.text, seg.avg_logprob, seg.no_speech_prob) == (0.0, 0.9, " Ada spoke.",
                                                                                       -0.2, 0.01)
