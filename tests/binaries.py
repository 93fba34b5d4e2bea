"""System programs the tests run (Debian packages, installed by ``scripts/install.sh``).

A test that needs one calls :func:`require` (or the media helpers do it for it): a missing program fails the test
with one line naming the program and the command that installs it, never a ``TypeError`` on ``None``, and never
a skip (a machine without them does not pass the suite).
"""

from __future__ import annotations

import shutil

import pytest

#: program on PATH -> the Debian package that ships it
PACKAGES = {"ffmpeg": "ffmpeg", "ffprobe": "ffmpeg", "espeak-ng": "espeak-ng", "chromium": "chromium"}


def missing_message(program: str) -> str:
    package = PACKAGES.get(program, program)
    return (f"{program} is not installed (not found on PATH); the tests need it: run `bash scripts/install.sh` "
            f"(Debian package {package})")


def require(program: str) -> str:
    """The path of ``program`` on PATH; fails the calling test (``pytest.fail``) naming it when it is missing."""
    path = shutil.which(program)
    if path is None:
        pytest.fail(missing_message(program), pytrace=False)
    return path


#: flags of every headless Chromium the tests start: no sandbox (root), and no background connections (this
#: machine's closed network refuses them, many at a time)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
