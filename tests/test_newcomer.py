"""A newcomer's first hour, again (issue 23): exit codes, skipped inputs, inputs checked before models load, the
serve notice, ``qa``'s rerun line, the CPU-only torch command. Each test failed on the code before its fix; none
loads a model (the help walk is ``tests/test_help.py``, the compose check is in ``tests/test_deploy.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specstream.cli import main

ROOT = Path(__file__).parent.parent


def _err_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_unreadable_source_is_one_code_on_every_command(tmp_path, capsys):
    """Item 1. Before: ``transcribe /missing.wav`` exited 1 with ``audio_decode_error``; ``generate
    --prompt-ids-file`` and ``simulate --trace`` called a missing file ``invalid_request``, while ``caption`` and
    ``qa`` said ``unreadable_source``. Now the one source of a command is fatal (exit 2), one of several inputs
    is a record (exit 1), and the code is ``unreadable_source`` everywhere."""
    missing = tmp_path / "missing.wav"
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    assert main(["transcribe", str(missing)]) == 2
    assert _err_lines(capsys) == [f"error [unreadable_source]: no such file: {missing}"]
    assert main(["transcribe", str(missing), "--format", "jsonl"]) == 2
    assert json.loads(capsys.readouterr().err) == {
        "error": {"code": "unreadable_source", "message": f"no such file: {missing}"}}
    assert main(["transcribe", str(empty)]) == 2
    assert _err_lines(capsys) == [f"error [unreadable_source]: file is empty (0 bytes): {empty}"]
    assert main(["transcribe", str(tmp_path)]) == 2
    assert _err_lines(capsys) == [f"error [unreadable_source]: is a directory, not a media file: {tmp_path}"]

    ids = tmp_path / "ids.jsonl"
    assert main(["generate", "--prompt-ids-file", str(ids), "--json"]) == 2
    assert json.loads(capsys.readouterr().err) == {
        "error": {"code": "unreadable_source", "message": f"--prompt-ids-file {ids}: No such file or directory"}}
    trace = tmp_path / "trace.jsonl"
    assert main(["simulate", "--trace", str(trace)]) == 2
    assert _err_lines(capsys) == [f"error [unreadable_source]: {trace}: No such file or directory"]
    manifest = tmp_path / "manifest.jsonl"
    assert main(["qa", str(manifest), "--out", str(tmp_path / "a.jsonl")]) == 2
    assert _err_lines(capsys) == [f"error [unreadable_source]: manifest {manifest}: no such file"]

    out = tmp_path / "c.jsonl"  # one of caption's inputs: a record, exit 1, and a line naming it on stderr
    assert main(["caption", str(tmp_path / "missing.mp4"), "--out", str(out)]) == 1
    assert json.loads(out.read_text()) == {"source": str(tmp_path / "missing.mp4"), "error": {
        "code": "unreadable_source", "message": f"no such file: {tmp_path / 'missing.mp4'}"}}


def test_caption_checks_inputs_before_loading_models(tmp_path, capsys, monkeypatch):
    """Items 2 and 3. Before: ``caption /missing.mp4`` loaded the models first (12.5 s; here: a missing
    ``--target`` failed the whole run with ``checkpoint_not_found``, exit 2), stderr gave only ``1 input (1
    failed)``, and a ``.txt`` in a folder was skipped without a word. Now the inputs are checked first: no model
    is loaded or even built (the model cache stays empty), each failed input is named with its reason, each
    skipped file is named and counted."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECSTREAM_CACHE", str(cache))
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "notes.txt").write_text("not media\n")
    (folder / "empty.mp4").write_bytes(b"")
    named = tmp_path / "named.txt"
    named.write_text("a text file given by name\n")
    out = tmp_path / "c.jsonl"
    missing = "/missing.mp4"
    code = main(["caption", missing, str(folder), str(named), "--out", str(out), "--target", str(tmp_path / "no")])
    err = _err_lines(capsys)
    assert code == 1
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["source"], r["error"]["code"]) for r in records] == [
        (missing, "unreadable_source"), (str(folder / "empty.mp4"), "unreadable_source"),
        (str(named), "unsupported_media")]
    assert err[:3] == [f"skipped {folder / 'notes.txt'}: neither an image nor a video (by content or extension)",
                       f"failed {missing} [unreadable_source]: no such file: {missing}",
                       f"failed {folder / 'empty.mp4'} [unreadable_source]: file is empty (0 bytes): "
                       f"{folder / 'empty.mp4'}"]
    assert err[3].startswith(f"failed {named} [unsupported_media]: {named}: neither an image nor a video")
    assert err[4].startswith("3 inputs (3 failed, 1 skipped): 0 frames decoded, 0 keyframes, no caption written in ")
    assert "tokens/s" not in err[4]  # before: "(0.0 tokens/s), tau 0.00" read as a measured speed
    assert len(err) == 5
    assert not cache.exists()  # the built-in models were not even created


def test_serve_notice_names_the_serve_flags():
    """Item 5. Before: ``serve`` printed "Point --target/--draft at real checkpoints"; its flags are
    ``--caption-target`` and ``--caption-draft``."""
    from specstream.pipeline.defaults import untrained_notice

    assert "Point --caption-target/--caption-draft at real checkpoints" in untrained_notice(
        ("--caption-target", "--caption-draft"))
    assert "e.g. --target llava-hf/" in untrained_notice()
    # what a running server prints: tests/test_first_use.py::test_upload_without_extension_is_recognised_by_content


def test_qa_rerun_with_nothing_left_says_so(tmp_path, capsys):
    """Item 7. Before: "0.0 questions/min, tau 0.00" for a rerun that had nothing to answer (after building the
    models)."""
    video = tmp_path / "clip.mp4"  # never opened: both questions are answered
    video.write_bytes(b"\0" * 64)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "v", "video": str(video), "questions": [{"id": "q1", "text": "What?"},
                                                                                  {"id": "q2", "text": "Who?"}]}) + "\n")
    answers = tmp_path / "a.jsonl"
    answers.write_text("".join(json.dumps({"id": "v", "question_id": q, "video": str(video), "answer": "x",
                                           "tokens": [1]}) + "\n" for q in ("q1", "q2")))
    assert main(["qa", str(manifest), "--out", str(answers), "--no-progress"]) == 0
    # and no model is built for it: no untrained-model notice either
    assert _err_lines(capsys) == ["2 questions of 1 video: nothing to do, 2 already answered"]
    from specstream.pipeline.qa_job import QaSummary

    line = QaSummary(videos=1, questions=2, answered=1, skipped=1, seconds=6.0, tokens=3, target_steps=2).line()
    assert line == "2 questions of 1 video: 1 answered, 0 failed, 1 already answered; 6.0 s (10.0 questions/min), tau 1.50"


def test_readme_gives_the_cpu_only_torch_command_with_sizes():
    """Item 8. Before: only the PyPI command, which pulls the CUDA wheels (6.8 GB of venv) on a CPU machine."""
    readme = (ROOT / "README.md").read_text()
    flat = " ".join(readme.split())
    cpu = "pip install torch==2.14.1 torchvision==0.29.1 --index-url https://download.pytorch.org/whl/cpu"
    assert "pip install torch==2.14.1 torchvision==0.29.1 && pip install -e" in readme and cpu in readme
    assert "torch==2.14.1 torchvision==0.29.1 --index-url https://download.pytorch.org/whl/cpu" in (
        ROOT / "deploy" / "Dockerfile").read_text()
    assert "takes **6.8 GB** (`du -sm`: 6828 MB)" in flat and "could not be measured" in flat
