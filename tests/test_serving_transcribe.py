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
