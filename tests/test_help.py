"""Every subcommand's ``--help``, walked: plain text (no reStructuredText markup), a description that ends as a
sentence, a help string on every flag, environment variables named (issue 23, item 4)."""

from __future__ import annotations

import argparse
import importlib
import re

import pytest

from specstream import cli

MARKUP = re.compile(r"``|:(?:class|func|meth|mod|attr|data|exc|obj):`|`~|\*\*")
# words a sentence does not end with: an unfinished text ("... against the")
DANGLING = {"a", "an", "the", "of", "and", "or", "to", "with", "for", "in", "by", "as", "from", "on", "at", "than",
            "that", "is", "are", "its", "their"}


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _parser_of(entry: str) -> argparse.ArgumentParser:
    """The parser a passthrough command (``module:function(argv)``) builds: its first parse call is stopped."""
    module, func = entry.split(":")
    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def grab(self, *a, **k):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = grab
    try:
        getattr(importlib.import_module(module), func)([])
    except _Captured as got:
        return got.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
    raise AssertionError(f"{entry} parsed no arguments")


def walk(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> list[tuple[tuple, argparse.ArgumentParser]]:
    """(words, parser) of the command and of every subcommand below it, passthrough commands included."""
    found = [(words, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                key = (*words, name)
                real = _parser_of(cli.PASSTHROUGH[key][1]) if key in cli.PASSTHROUGH else sub
                found.extend(walk(real, key))
    return found


def problems(words: tuple, parser: argparse.ArgumentParser) -> list[str]:
    """What is wrong with one command's help (empty when nothing)."""
    name = " ".join(("specstream", *words))
    out = []
    text = parser.format_help()
    if MARKUP.search(text):
        out.append(f"{name}: markup {MARKUP.search(text).group(0)!r} in the help")
    desc = (parser.description or "").strip()
    if not desc:
        out.append(f"{name}: no description")
    elif desc[-1] not in ".!?)":
        out.append(f"{name}: the description ends mid-sentence: ...{desc[-50:]!r}")
    for action in parser._actions:
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction) and not action.help:
            out.append(f"{name}: positional {action.dest} has no help")
        if not action.option_strings:
            continue
        flag = "/".join(action.option_strings)
        helptext = (action.help or "").strip()
        if not helptext or helptext == argparse.SUPPRESS:
            out.append(f"{name} {flag}: no help")
            continue
        last = re.findall(r"[\w']+|[^\w\s]", helptext)[-1].lower()
        if last in DANGLING or last in (",", ";", ":", "-"):
            out.append(f"{name} {flag}: help ends mid-sentence: {helptext!r}")
        if re.search(r"\benv\b", helptext) and not re.search(r"SPECSTREAM_[A-Z_]+", helptext):
            out.append(f"{name} {flag}: mentions the environment without naming the variable: {helptext!r}")
    return out


def test_every_subcommand_help_is_plain_complete_text():
    """Before: RST markup on the top level, worker and five bench commands; ``bench scheduler``'s description cut
    mid-sentence; flags without help (``--mode``, ``--temperature``, ``--dtype``, ``--device``, ``--prompt``,
    ``--no-progress``, ...); ``worker --allowed-root`` said "(env: JSON list)"."""
    commands = walk(cli.build_parser())
    names = {" ".join(w) for w, _ in commands}
    # every subcommand is walked, the bench ones and the nested ``models fetch`` / ``models list`` included
    assert {"", "generate", "caption", "qa", "transcribe", "simulate", "worker", "serve", "models", "models fetch",
            "models list", "bench", "bench spec", "bench scheduler", "bench keyframes", "bench caption",
            "bench kafka", "bench qa", "bench subtitles", "bench mixed", "bench transcribe"} <= names
    assert len(commands) == 21, sorted(names)
    found = [p for words, parser in commands for p in problems(words, parser)]
    assert found == []


def test_models_fetch_help_lists_the_names():
    from specstream.pipeline.models_fetch import MODELS

    (parser,) = [p for w, p in walk(cli.build_parser()) if w == ("models", "fetch")]
    text = " ".join(parser.format_help().split())
    assert all(name in text for name in MODELS), text
    assert "qwen2.5-coder-1.5b-instruct: Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M" in text


@pytest.mark.parametrize("text, want", [
    ("Ends well.", []),
    ("SLO attainment of the QoS scheduler against the", ["ends mid-sentence"]),
    ("The ``specstream`` command line.", ["markup '``'"]),
    ("Uses :class:`Captioner`.", ["markup ':class:`'"]),
])
def test_the_checks_catch_what_they_name(text, want):
    """The walker's own checks, on parsers made to fail them (so an empty ``problems`` list means something)."""
    p = argparse.ArgumentParser(prog="x", description=text)
    p.add_argument("--fine", help="a flag (default 1)")
    got = problems((), p)
    assert [w for w in want if not any(w in g for g in got)] == [] and len(got) == len(want), got
    p.add_argument("--bare")
    p.add_argument("--cut", help="keyframes per minute of the")
    p.add_argument("--env", help="the roots (env: JSON list)")
    got = problems((), p)[len(want):]
    assert got == ["specstream --bare: no help", "specstream --cut: help ends mid-sentence: 'keyframes per minute "
                   "of the'", "specstream --env: mentions the environment without naming the variable: 'the roots "
                   "(env: JSON list)'"]
