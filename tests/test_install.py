"""``scripts/install.sh`` (the README's install command runs it): which apt-get commands it issues, as root and
through sudo, and that a second run issues none.

The real apt-get cannot run in a test (it changes the machine), so apt-get, sudo and id are small recording
programs on a PATH that holds none of the real ffmpeg, ffprobe, espeak-ng or chromium; the fake apt-get
"installs" a package by creating its programs, so the idempotence check sees the result of the first run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "scripts" / "install.sh"
PROGRAMS = {"ffmpeg": ["ffmpeg", "ffprobe"], "espeak-ng": ["espeak-ng"], "chromium": ["chromium"]}

FAKE_APT = """#!/bin/sh
echo "$SUDO_MARK apt-get $* DEBIAN_FRONTEND=$DEBIAN_FRONTEND" >> "$LOG"
if [ "$1" = install ]; then
  for arg in "$@"; do
    case "$arg" in
      ffmpeg) progs="ffmpeg ffprobe";; espeak-ng) progs="espeak-ng";; chromium) progs="chromium";; *) progs="";;
    esac
    for p in $progs; do printf '#!/bin/sh\\n' > "$INSTALLED/$p"; chmod +x "$INSTALLED/$p"; done
  done
fi
"""
FAKE_SUDO = """#!/bin/sh
SUDO_MARK=sudo exec "$@"
"""
FAKE_ID = """#!/bin/sh
echo "$FAKE_UID"
"""


@pytest.fixture()
def box(tmp_path):
    fake, installed, tools = tmp_path / "fake", tmp_path / "installed", tmp_path / "tools"
    for d in (fake, installed, tools):
        d.mkdir()
    for name, text in (("apt-get", FAKE_APT), ("id", FAKE_ID)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    for tool in ("env", "sh", "chmod"):  # what the script and the fakes run besides bash builtins
        os.symlink(shutil.which(tool), tools / tool)
    log = tmp_path / "apt.log"

    def run(uid: int, sudo: bool = True, present: tuple[str, ...] = ()):
        if sudo:
            (fake / "sudo").write_text(FAKE_SUDO)
            (fake / "sudo").chmod(0o755)
        elif (fake / "sudo").exists():
            (fake / "sudo").unlink()
        for prog in present:
            (installed / prog).write_text("#!/bin/sh\n")
            (installed / prog).chmod(0o755)
        log.write_text("")
        env = {"PATH": f"{fake}:{installed}:{tools}", "LOG": str(log), "INSTALLED": str(installed),
               "FAKE_UID": str(uid), "SUDO_MARK": ""}
        proc = subprocess.run([shutil.which("bash"), str(SCRIPT)], env=env, capture_output=True, text=True,
                              timeout=30)
        return proc, [line.strip() for line in log.read_text().splitlines()]

    return run


def test_as_root_installs_all_then_nothing(box):
    proc, calls = box(uid=0)
    assert proc.returncode == 0, proc.stderr
    assert calls == ["apt-get update -qq DEBIAN_FRONTEND=noninteractive",
                     "apt-get install -y -qq ffmpeg espeak-ng chromium DEBIAN_FRONTEND=noninteractive"]
    proc, calls = box(uid=0)  # idempotent: everything is there now
    assert proc.returncode == 0 and calls == []
    assert "installed" in proc.stdout


def test_not_root_uses_sudo_for_what_is_missing(box):
    proc, calls = box(uid=1000, present=("ffmpeg", "ffprobe", "espeak-ng"))
    assert proc.returncode == 0, proc.stderr
    assert calls == ["sudo apt-get update -qq DEBIAN_FRONTEND=noninteractive",
                     "sudo apt-get install -y -qq chromium DEBIAN_FRONTEND=noninteractive"]


def test_not_root_without_sudo_names_the_packages(box):
    proc, calls = box(uid=1000, sudo=False, present=("chromium",))
    assert proc.returncode == 1 and calls == []
    assert "missing ffmpeg espeak-ng; not root and no sudo" in proc.stderr


def test_readme_install_command_and_ci_run_call_the_script():
    root = SCRIPT.parent.parent
    readme = (root / "README.md").read_text()
    block = readme.split("## Install", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    steps = [s.strip() for s in block.strip().split("&&")]
    assert steps[:3] == ["bash scripts/install.sh", "pip install torch==2.14.1 torchvision==0.29.1",
                         "pip install -e '.[all,test]'"]
    ci = [line.strip() for line in (root / ".ci" / "run").read_text().splitlines()]
    assert ci.index("bash scripts/install.sh") < ci.index("pip install -q torch==2.14.1 torchvision==0.29.1")
    assert not any("apt-get" in line for line in ci if not line.startswith("#"))  # one place installs packages


def test_missing_programs_fail_naming_them(monkeypatch, tmp_path, src):
    """With none of the programs on PATH, each helper that runs one fails with a line naming it (before: a
    ``TypeError`` on ``None`` for ffprobe)."""
    import media
    from test_video import _ffmpeg_rgb, _ffprobe_times
    from whisper_fixtures import speak

    from binaries import require

    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory
    cases = [("ffprobe", lambda: _ffprobe_times(src["gif"])),
             ("ffmpeg", lambda: _ffmpeg_rgb(src["bikes"], 0, 320, 240)),
             ("ffmpeg", lambda: media.ffmpeg("-version")),
             ("espeak-ng", lambda: speak("hello", tmp_path / "hello.wav")),
             ("chromium", lambda: require("chromium"))]
    for program, call in cases:
        with pytest.raises(pytest.fail.Exception) as err:
            call()
        assert str(err.value).startswith(f"{program} is not installed"), str(err.value)
        assert "bash scripts/install.sh" in str(err.value)
