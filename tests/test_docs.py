"""The manual tells the truth about commands: every ``specstream`` command written in README.md and docs/ parses
with the parser that really runs it, the ``simulate`` example prints what the page says, and the pages speak
to users (terms defined, no references to the project's own issue tracker).

Commands come from inline code spans and ``bash`` blocks. A synopsis is expanded before parsing: ``[...]``
optional groups are dropped, ``a|b|c`` alternatives each give a command, ``X...`` becomes ``X``, and an
upper-case placeholder given to an option that takes a number or a choice becomes a valid value. A span that
only names a command (no arguments) is a reference, not a command, and is skipped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SUBCOMMANDS = ("caption", "generate", "transcribe", "simulate", "worker", "serve", "bench", "models", "qa")


class _Parsed(BaseException):
    pass


class _ParseError(BaseException):
    pass


def _spans(text: str) -> list[str]:
    out = [m.group(1) for m in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", text)]
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        out += [line for line in block.replace("\\\n", " ").splitlines()]
    return out


def documented_commands() -> list[tuple[str, str]]:
    """(page, command text) of every command in the pages."""
    found = []
    for page in PAGES:
        for span in _spans(page.read_text()):
            for part in span.split("&&"):
                words = part.replace("\\|", "|").split()
                if words and words[0] == "specstream":
                    words = words[1:]
                if not words or words[0] not in SUBCOMMANDS or not any(w.startswith("-") for w in words):
                    continue
                found.append((page.name, " ".join(words)))
    return found


def expand(synopsis: str) -> list[list[str]]:
    text = synopsis
    while re.search(r"\[[^\[\]]*\]", text):
        text = re.sub(r"\s*\[[^\[\]]*\]", "", text)
    words = [w[:-3] if w.endswith("...") and len(w) > 3 else w for w in shlex.split(text)]
    choices = [w.split("|") if "|" in w and not w.startswith("-") else [w] for w in words]
    return [list(c) for c in itertools.product(*choices)]


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    out = dict(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.update({k: v for k, v in _actions(sub).items() if k not in out})
    return out


def _sample(action: argparse.Action, value: str) -> str:
    """A valid value in place of an upper-case placeholder given to a typed or choice option."""
    if not re.fullmatch(r"[A-Z][A-Z0-9_]*", value):
        return value
    if action.choices:
        return str(list(action.choices)[0])
    if action.type in (int, float):
        return "1"
    return value


def parse_only(argv: list[str], monkeypatch) -> str | None:
    """Run ``specstream ARGV`` up to its argument parsing; the parse error, or None when it parsed."""
    from specstream.cli import main

    real_parse = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        args = list(args)
        acts = _actions(self)
        for i in range(1, len(args)):
            act = acts.get(args[i - 1])
            if act is not None and act.nargs is None:
                args[i] = _sample(act, args[i])
        real_parse(self, args, namespace)
        raise _Parsed()

    def error(self, message):
        raise _ParseError(f"{self.prog}: {message}")

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        m.setattr(argparse.ArgumentParser, "error", error)
        try:
            main(argv)
        except _Parsed:
            return None
        except _ParseError as exc:
            return str(exc)
    return "ran past its argument parsing without parsing them"


def test_every_documented_command_parses(monkeypatch):
    """Before: ``bench scheduler`` was documented without its required ``--out``."""
    commands = documented_commands()
    assert len(commands) >= 15
    bad = []
    for page, synopsis in commands:
        for argv in expand(synopsis):
            problem = parse_only(argv, monkeypatch)
            if problem is not None:
                bad.append(f"{page}: `specstream {' '.join(argv)}`: {problem}")
    assert not bad, "\n".join(bad)


def test_simulate_example_in_the_docs_prints_what_the_page_says(tmp_path, monkeypatch, capsys):
    """docs/scheduler.md's trace example, run as written (in the trace's directory), prints the output the page
    shows."""
    text = (ROOT / "docs" / "scheduler.md").read_text()
    trace = re.search(r"```jsonl\n(.*?)```", text, re.S).group(1)
    (cmd,) = re.findall(r"```bash\n(specstream simulate [^\n]*)\n```", text)
    shown = json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))
    (tmp_path / "trace.jsonl").write_text(trace)
    argv = shlex.split(cmd)
    assert argv[:4] == ["specstream", "simulate", "--trace", "trace.jsonl"], cmd
    from specstream.schedulers.simulator import load_trace

    assert len(load_trace(tmp_path / "trace.jsonl")) == len(trace.strip().splitlines())
    from specstream.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv[1:]) == 0
    assert json.loads(capsys.readouterr().out) == shown


def test_terms_are_defined_and_pages_do_not_speak_of_issues():
    """``tau`` (printed by several commands) is defined where it is first used; no page or user-facing
    docstring refers to "issue N", "the issue" or its "goal"."""
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"\*\*tau\*\*[^.]*mean number of tokens\s+committed per target forward", readme)
    pattern = re.compile(r"\bissue\s*#?\d+|\bthe issue\b|\bissue's\b|\bgoals?\b", re.I)
    hits = []
    for path in PAGES + sorted(p for d in ("pipeline", "stages", "modalities", "schedulers", "kernels", "specstream")
                               for p in (ROOT / d).rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("name", ["captions.jsonl", "out/captions.jsonl"])
def test_the_readmes_output_is_not_committed_by_accident(name):
    """``captions.jsonl``, what the README's install command writes, is ignored by git."""
    import shutil

    if (ROOT / ".git").exists() and shutil.which("git"):
        assert subprocess.run(["git", "check-ignore", "-q", name], cwd=ROOT).returncode == 0
    else:  # an unpacked source tree: read the pattern
        assert "captions.jsonl" in (ROOT / ".gitignore").read_text().split()
