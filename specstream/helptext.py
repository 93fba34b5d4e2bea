"""Help text for ``--help`` from a module's docstring: the same words, without the reStructuredText markup.

A command whose module docstring is also its ``--help`` description passes it through :func:`doc_help`, so the
developer's docstring stays the one source and the terminal shows plain text (``tests/test_help.py`` walks every
subcommand's help and fails on markup, on flags without help and on unfinished sentences).
"""

from __future__ import annotations

import re

# :class:`~pkg.mod.Name` -> Name, :func:`pkg.f` -> pkg.f (Sphinx's cross-reference roles, `~` shows the last part)
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_INTERPRETED = re.compile(r"(?<![`\w])`([^`]+)`(?![`\w])")
_STRONG = re.compile(r"\*\*([^*]+)\*\*")
_LEAD = re.compile(r"\A``specstream [^`]+``: *")


def _role(m: re.Match) -> str:
    return m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)


def doc_help(doc: str) -> str:
    """``doc`` (a module docstring) as plain text for an argparse ``description``.

    The leading ``specstream CMD``: (the usage line already names the command) is dropped and the next word
    capitalised; ````literal````, ```interpreted``` and ``**strong**`` become their text; Sphinx roles (``:class:`~a.B```) become
    the name they show. Paragraphs and line breaks are kept (use it with ``argparse.RawDescriptionHelpFormatter``).

    Args:
        doc: the docstring, ``str``.

    Returns:
        The text, stripped of surrounding whitespace.
    """
    text = _LEAD.sub("", doc.strip())
    text = _ROLE.sub(_role, text)
    text = _LITERAL.sub(r"\1", text)
    text = _INTERPRETED.sub(r"\1", text)
    text = _STRONG.sub(r"\1", text)
    return text[:1].upper() + text[1:]
