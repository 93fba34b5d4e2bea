"""A newcomer's first hour: the small things that were in the way (each test failed before its fix)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specstream.pipeline.tansu import free_port


def test_worker_against_an_unreachable_broker_is_one_line_and_exit_2():
    """Before: a 38-line traceback."""
    port = free_port()  # nothing listens there
    proc = subprocess.run([sys.executable, "-m", "specstream", "worker", "--broker", f"kafka://127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"error [broker_unreachable]: cannot reach the Kafka broker at "
                                        f"127.0.0.1:{port} (check --broker / SPECSTREAM_KAFKA_BOOTSTRAP)"]


def test_api_docs_page_works_offline():
    """Before: ``/docs`` loaded Swagger UI from a CDN (blank offline). Every script and style sheet of the page
    is served by the app itself."""
    from fastapi.testclient import TestClient

    from specstream.pipeline.server import ServerSettings, create_app

    client = TestClient(create_app(ServerSettings()))  # no lifespan: no speech model is loaded
    page = client.get("/docs")
    assert page.status_code == 200
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']|url: ?["']([^"']+)["']""", page.text)
    urls = [a or b for a, b in urls]
    assert urls and not [u for u in urls if "://" in u or u.startswith("//")], urls
    assert "/openapi.json" in urls
    for url in urls:
        res = client.get(url)
        assert res.status_code == 200 and len(res.content) > 0, url
    js = client.get("/docs/assets/swagger-ui-bundle.js")
    assert len(js.content) > 100_000 and "SwaggerUIBundle" in js.text
    assert "/v1/captions" in client.get("/openapi.json").json()["paths"]


def test_serve_model_flags_map_to_the_settings(monkeypatch):
    """``--caption-target``, ``--caption-draft``, ``--speech-model``: flags over ``SPECSTREAM_*`` variables."""
    from specstream.pipeline.server import build_parser, settings_from_args

    monkeypatch.setenv("SPECSTREAM_CAPTION_DRAFT", "env-draft")
    monkeypatch.setenv("SPECSTREAM_SPEECH_MODEL", "env-speech")
    s = settings_from_args(build_parser().parse_args(["--caption-target", "llava-hf/x", "--speech-model",
                                                      "whisper-base"]))
    assert (s.caption_target, s.caption_draft, s.speech_model) == ("llava-hf/x", "env-draft", "whisper-base")
    s = settings_from_args(build_parser().parse_args(["--caption-draft", "d"]))
    assert (s.caption_target, s.caption_draft, s.speech_model) == (None, "d", "env-speech")
    help_text = build_parser().format_help()
    assert all(f in help_text for f in ("--caption-target", "--caption-draft", "--speech-model",
                                        "SPECSTREAM_CAPTION_TARGET"))


def test_one_error_line_format_per_output_mode(tmp_path, capsys):
    """On stderr a fatal error is ``error [code]: message``; in the JSON output modes (``--json``, ``--format
    jsonl``) it is ``{"error": {"code", "message"}}``. Before: ``error: ...`` without a code next to
    ``error [code]: ...``, and JSON in text mode."""
    from specstream.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("[1, 2]\n")
    missing = str(tmp_path / "no-model")
    cases = [
        (["generate", "--target", missing, "--prompt-ids", "1", "--max-new-tokens", "1"], "checkpoint_not_found"),
        (["generate", "--target", missing, "--prompt-ids", "1", "--max-new-tokens", "1", "--tree", "0"],
         "invalid_request"),
        (["caption", str(trace), "--tree", "x"], "invalid_request"),
        (["simulate", "--trace", str(trace)], "invalid_request"),
        (["worker", "--broker", "localhost:9092"], "invalid_request"),
        (["serve", "--port", "eighty"], None),  # argparse's own usage error
    ]
    for argv, code in cases:
        for as_json in (False, True):
            if as_json and argv[0] not in ("generate", "simulate"):
                continue
            assert main(argv + (["--json"] if as_json else [])) == 2, argv
            lines = capsys.readouterr().err.strip().splitlines()
            if code is None:
                assert lines[-1].startswith("specstream serve: error: argument --port")
                continue
            assert len(lines) == 1, lines
            if as_json:
                assert json.loads(lines[0])["error"]["code"] == code, lines
            else:
                assert lines[0].startswith(f"error [{code}]: "), lines


def test_media_recognised_by_content(tmp_path, src, clips):
    """Images and videos by their content: without an extension, or under a wrong one; the extension decides
    only when the content says nothing (an empty file: its loader reports it)."""
    from specstream.errors import UnsupportedMediaError
    from specstream.pipeline.caption_job import expand_inputs
    from specstream.stages.caption import media_kind

    d = tmp_path / "in"
    d.mkdir()
    shutil.copy(src["astronaut"], d / "photo")  # PNG, no extension
    shutil.copy(src["rocket"], d / "rocket.bin")  # JPEG
    shutil.copy(clips["short.mp4"], d / "clip")  # MP4, no extension
    shutil.copy(clips["short.webm"], d / "clip.png")  # WebM named .png
    shutil.copy(src["gif"], d / "anim")  # GIF: a video here
    (d / "notes.txt").write_text("not media\n")
    (d / "empty.mp4").write_bytes(b"")
    kinds = {p.name: media_kind(str(p)) for p in d.iterdir() if p.name != "notes.txt"}
    assert kinds == {"photo": "image", "rocket.bin": "image", "clip": "video", "clip.png": "video",
                     "anim": "video", "empty.mp4": "video"}
    with pytest.raises(UnsupportedMediaError, match="neither an image nor a video"):
        media_kind(str(d / "notes.txt"))
    files, skipped = expand_inputs([str(d)])
    assert [Path(p).name for p in files] == ["anim", "clip", "clip.png", "empty.mp4", "photo", "rocket.bin"]
    assert [Path(p).name for p in skipped] == ["notes.txt"]


def test_upload_without_extension_is_recognised_by_content(src, capsys):
    """``POST /v1/captions`` with a PNG uploaded as ``photo`` (no extension): captioned as an image (before:
    ``unsupported_media``). The untrained-models notice names serve's own flags (before: ``--target/--draft``)."""
    from fastapi.testclient import TestClient

    from specstream.pipeline.server import ServerSettings, create_app

    client = TestClient(create_app(ServerSettings()))
    data = Path(src["astronaut"]).read_bytes()
    res = client.post("/v1/captions", files={"file": ("photo", data, "application/octet-stream")},
                      data={"max_new_tokens": "2"})
    assert res.status_code == 200, res.text
    (rec,) = res.json()["records"]
    assert (rec["source"], rec["kind"], len(rec["tokens"])) == ("photo", "image", 2)
    err = capsys.readouterr().err
    assert "Point --caption-target/--caption-draft at real checkpoints, e.g. --caption-target llava-hf/" in err, err
