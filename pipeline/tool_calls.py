"""OpenAI's ``tools`` / ``tool_choice`` on ``/v1/chat/completions``: the JSON Schema a forced tool call is
constrained to, the prompt text that shows the tools to the model, and the tool calls read back from the output
(whole, or incrementally for a stream).

The output format of a tool call is one JSON object ``{"name": "<function>", "arguments": {...}}`` (the shape
Hermes/Qwen2.5 tool prompts use inside ``<tool_call>`` tags, without the tags), with the grammar's fixed
separators (``", "``, ``": "``; :meth:`~specstream.stages.speculative.grammar.Grammar.from_json_schema`), so the
text after ``{"name": "<function>", "arguments": `` up to the last ``}`` is the arguments' JSON as OpenAI returns it
(a string) and can be streamed as argument fragments.

``tool_choice``:

- ``"none"``: the tools are not shown and the output is text;
- ``"required"``: the output is constrained to a call of one of the tools (an ``anyOf`` over the functions);
- ``{"type": "function", "function": {"name": F}}``: constrained to a call of ``F``;
- ``"auto"`` (the default when tools are given): **unconstrained**; an output that is a whole JSON object of the
  tool-call shape naming one of the tools is returned as a tool call, anything else as text (a documented
  choice: a grammar "text or a tool call" would force the text branch to exclude a leading ``{``). In a stream,
  an output whose first non-blank character is ``{`` is held back until it ends, then sent as a tool call or as
  text; other outputs stream as text.

One call per choice (``parallel_tool_calls`` is accepted; at most one call is made).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from specstream.errors import InvalidSchemaError, UnsupportedParameterError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


def _bad(exc, param: str):
    exc.param = param
    return exc


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools.

    Attributes:
        mode: ``none``, ``auto``, ``required`` or ``named``.
        functions: name -> parameters JSON Schema, in the request's order.
        descriptions: name -> description ("" when absent).
        forced: the function a ``named`` choice calls (None otherwise).
    """

    mode: str
    functions: dict[str, dict] = field(default_factory=dict)
    descriptions: dict[str, str] = field(default_factory=dict)
    forced: str | None = None

    @property
    def constrained(self) -> bool:
        """The output is a tool call by construction (``required``, ``named``)."""
        return self.mode in ("required", "named")

    @property
    def active(self) -> bool:
        return self.mode != "none" and bool(self.functions)

    def schema(self) -> dict[str, Any] | None:
        """The JSON Schema of the output (``required``/``named``), None for ``auto``/``none``."""
        if not self.constrained:
            return None
        names = [self.forced] if self.mode == "named" else list(self.functions)
        calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": self.functions[n]},
                  "required": ["name", "arguments"], "additionalProperties": False} for n in names]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def system_text(self) -> str:
        """The system-prompt text that shows the tools to the model (``auto``, ``required``, ``named``)."""
        lines = ["You may call a function. To call one, answer with only a JSON object "
                 '{"name": <function name>, "arguments": <arguments object>}. Functions:']
        for n, params in self.functions.items():
            desc = self.descriptions.get(n) or ""
            lines.append(json.dumps({"name": n, "description": desc, "parameters": params}, ensure_ascii=False))
        if self.mode == "named":
            lines.append(f"Call the function {self.forced}.")
        elif self.mode == "required":
            lines.append("You must call one of these functions.")
        return "\n".join(lines)


def tool_plan(tools: Any, tool_choice: Any) -> ToolPlan:
    """Validate OpenAI's ``tools`` and ``tool_choice``.

    Raises:
        InvalidSchemaError (param ``tools``): a tool that is not ``{"type": "function", "function": {"name", ...}}``,
            a bad or repeated name, ``parameters`` that is not an object (whether the schemas compile is checked
            when the grammar is built).
        UnsupportedParameterError (param ``tool_choice``): an unknown choice, a named function not in ``tools``,
            ``required`` / a named function without tools.
    """
    functions: dict[str, dict] = {}
    descriptions: dict[str, str] = {}
    if tools not in (None, []):
        if not isinstance(tools, list):
            raise _bad(InvalidSchemaError("tools must be a list of function tools"), "tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
                raise _bad(InvalidSchemaError('each tool must be {"type": "function", "function": {...}}'),
                           f"tools.{i}")
            name = fn.get("name")
            if not isinstance(name, str) or not _NAME.match(name):
                raise _bad(InvalidSchemaError("a function name must match [A-Za-z0-9_-]{1,64}"),
                           f"tools.{i}.function.name")
            if name in functions:
                raise _bad(InvalidSchemaError(f"function {name!r} is listed twice"), f"tools.{i}.function.name")
            params = fn.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(params, dict):
                raise _bad(InvalidSchemaError("function parameters must be a JSON Schema object"),
                           f"tools.{i}.function.parameters")
            functions[name] = params
            descriptions[name] = fn.get("description") if isinstance(fn.get("description"), str) else ""
    choice = tool_choice if tool_choice is not None else ("auto" if functions else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad(UnsupportedParameterError(f"tool_choice {choice!r} is not one of none, auto, required or "
                                                 "a named function"), "tool_choice")
        if choice == "required" and not functions:
            raise _bad(UnsupportedParameterError("tool_choice 'required' needs tools"), "tool_choice")
        return ToolPlan(choice, functions, descriptions)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict):
        raise _bad(UnsupportedParameterError('a named tool_choice is {"type": "function", "function": {"name": '
                                             '...}}'), "tool_choice")
    if fn.get("name") not in functions:
        raise _bad(UnsupportedParameterError(f"tool_choice names {fn.get('name')!r}, which is not in tools"),
                   "tool_choice")
    return ToolPlan("named", functions, descriptions, fn["name"])


def _prefix(name: str) -> str:
    return '{"name": "' + name + '", "arguments": '


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_tool_call(plan: ToolPlan, text: str) -> tuple[str, str] | None:
    """``(function name, arguments JSON text)`` of an output that is one whole tool call of ``plan``'s functions,
    else None. The arguments text is the output's own (constrained outputs), or re-serialised when the model
    wrote other spacing (``auto``)."""
    stripped = text.strip()
    try:
        obj = json.loads(stripped)
    except json.JSONDecodeError:
        return None
    if not (isinstance(obj, dict) and set(obj) == {"name", "arguments"} and obj["name"] in plan.functions
            and isinstance(obj["arguments"], dict)):
        return None
    head = _prefix(obj["name"])
    if stripped.startswith(head) and stripped.endswith("}"):
        return obj["name"], stripped[len(head):-1]
    return obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)


class ToolCallStream:
    """One streamed choice's tool call, read from its text deltas as OpenAI streams tool calls: a first delta
    ``{"tool_calls": [{"index": 0, "id", "type": "function", "function": {"name", "arguments": ""}}]}``, then
    ``{"tool_calls": [{"index": 0, "function": {"arguments": <fragment>}}]}`` deltas whose fragments concatenate
    to the arguments' JSON text.

    :meth:`feed` takes each text delta and returns the chat deltas to send; :meth:`finish` the last ones and the
    choice's ``finish_reason``. Constrained plans stream the arguments as they come (the last character, the call
    object's closing ``}``, is held back); ``auto`` streams text unless the output starts with ``{``, which is held
    back to the end (module docstring).
    """

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.buf = ""  # text not yet sent
        self.state = "start"  # start -> (args | text | held)
        self.call_id = new_call_id()
        self.name: str | None = None
        self.sent_text = False

    def _header(self, name: str) -> dict:
        return {"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    @staticmethod
    def _args(fragment: str) -> dict:
        return {"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        self.buf += text
        out: list[dict] = []
        if self.state == "start":
            lead = self.buf.lstrip()
            if not lead:
                return out
            if not self.plan.constrained:
                if lead[0] == "{":
                    self.state = "held"
                else:
                    self.state = "text"
            else:
                for name in self.plan.functions:
                    if self.buf.startswith(_prefix(name)):
                        self.name = name
                        out.append(self._header(name))
                        self.buf = self.buf[len(_prefix(name)):]
                        self.state = "args"
                        break
                else:
                    return out  # the name is not complete yet
        if self.state == "text":
            out.append({"content": self.buf})
            self.sent_text = True
            self.buf = ""
        elif self.state == "args" and len(self.buf) > 1:
            out.append(self._args(self.buf[:-1]))
            self.buf = self.buf[-1:]
        return out

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The remaining deltas and the finish reason: ``tool_calls`` for a whole call, else the engine's."""
        out: list[dict] = []
        if self.state == "args":
            if finish_reason == "stop" and self.buf == "}":
                return out, "tool_calls"
            if self.buf:
                out.append(self._args(self.buf))
            return out, finish_reason
        if self.state == "held" or (self.state == "start" and not self.plan.constrained):
            call = parse_tool_call(self.plan, self.buf) if finish_reason == "stop" else None
            if call is not None:
                out += [self._header(call[0]), self._args(call[1])]
                return out, "tool_calls"
        if self.buf:
            out.append({"content": self.buf})  # a constrained call cut before its name ended: the partial text
        return out, finish_reason
