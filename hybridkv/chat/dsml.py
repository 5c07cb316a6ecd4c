"""DSML, the V4 tool-call markup: render OpenAI tool calls into it, and parse it back.

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

String arguments are written as they are (`string="true"`); every other JSON value is written
as JSON (`string="false"`). Arguments that are not a JSON object are passed as one string
parameter named `arguments`. A value that holds the DSML marker itself (a forged closing tag,
a second invoke) is written as a JSON string with the marker's characters escaped
(`\\uff5cDSML\\uff5c`, `string="false"`), so that it parses back to itself and never to markup;
names that markup cannot hold (a quote, a newline, an angle bracket, the marker) are refused.

Rendering yields parts `(text, trusted)`: the markup is the template's, names and values are the
caller's content (see hybridkv.chat.format's segments).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML}tool_calls>"
CALLS_CLOSE = f"</{DSML}tool_calls>"

_INVOKE = re.compile(rf'<{DSML}invoke name="([^"\n]*)">\n(.*?)</{DSML}invoke>', re.DOTALL)
_PARAM = re.compile(rf'<{DSML}parameter name="([^"\n]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.DOTALL)


class DSMLError(ValueError):
    """A DSML block that does not parse, or a tool call that DSML cannot hold."""


_ESCAPED_DSML = json.dumps(DSML, ensure_ascii=True)[1:-1]     # \uff5cDSML\uff5c
_BAD_NAME = re.compile(rf'["\n<>]|{DSML}')

Parts = list[tuple[str, bool]]


@dataclass
class ToolCall:
    name: str
    arguments: str          # a JSON object, as text


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except UnicodeEncodeError:
        return json.dumps(value, ensure_ascii=True)


def writable_name(name: Any) -> bool:
    """Whether DSML markup can hold `name` as a tool or argument name."""
    return isinstance(name, str) and not _BAD_NAME.search(name)


def _name(name: Any, what: str) -> str:
    if not writable_name(name):
        raise DSMLError(f"{what} {name!r} cannot be written in DSML: it must be a string without quotes, "
                        f"newlines, angle brackets or {DSML!r}")
    return name


def _argument_parts(arguments: str) -> Parts:
    try:
        values = json.loads(arguments)
    except (TypeError, ValueError):
        values = {"arguments": arguments}
    if not isinstance(values, dict):
        values = {"arguments": arguments}
    parts: Parts = []
    for i, (key, value) in enumerate(values.items()):
        is_str = isinstance(value, str) and DSML not in value
        text = value if is_str else _json(value).replace(DSML, _ESCAPED_DSML)
        parts += [("\n" if i else "", True), (f'<{DSML}parameter name="', True),
                  (_name(key, "argument name"), False), (f'" string="{"true" if is_str else "false"}">', True),
                  (text, False), (f"</{DSML}parameter>", True)]
    return parts


def render_arguments(arguments: str) -> str:
    return "".join(text for text, _ in _argument_parts(arguments))


def tool_call_parts(calls: list[dict]) -> Parts:
    """The DSML block of calls given as {"name": ..., "arguments": "<json object>"}, as parts."""
    parts: Parts = [(f"{CALLS_OPEN}\n", True)]
    for i, c in enumerate(calls):
        parts += [("\n" if i else "", True), (f'<{DSML}invoke name="', True), (_name(c.get("name"), "tool name"), False),
                  ('">\n', True), *_argument_parts(c.get("arguments") or "{}"), (f"\n</{DSML}invoke>", True)]
    return parts + [(f"\n{CALLS_CLOSE}", True)]


def render_tool_calls(calls: list[dict]) -> str:
    """The DSML block of calls given as {"name": ..., "arguments": "<json object>"}."""
    return "".join(text for text, _ in tool_call_parts(calls))


def parse_tool_calls(block: str) -> list[ToolCall]:
    """Tool calls from a DSML block (from `<｜DSML｜tool_calls>` to its closing tag; text outside
    the invokes may only be whitespace). Raises DSMLError when the markup is malformed."""
    start, end = block.find(CALLS_OPEN), block.rfind(CALLS_CLOSE)
    if start < 0 or end < start:
        raise DSMLError("no complete tool_calls block")
    body = block[start + len(CALLS_OPEN):end]
    calls, pos = [], 0
    for m in _INVOKE.finditer(body):
        if body[pos:m.start()].strip():
            raise DSMLError(f"unexpected text between invokes: {body[pos:m.start()]!r}")
        pos = m.end()
        args: dict[str, Any] = {}
        ppos = 0
        inner = m.group(2)
        for p in _PARAM.finditer(inner):
            if inner[ppos:p.start()].strip():
                raise DSMLError(f"unexpected text between parameters: {inner[ppos:p.start()]!r}")
            ppos = p.end()
            key, is_str, raw = p.groups()
            if key in args:
                raise DSMLError(f"parameter {key!r} given twice")
            if is_str == "true":
                args[key] = raw
            else:
                try:
                    args[key] = json.loads(raw)
                except ValueError:
                    raise DSMLError(f"parameter {key!r} is marked string=\"false\" but is not JSON: {raw!r}") from None
        if inner[ppos:].strip():
            raise DSMLError(f"unexpected text after parameters: {inner[ppos:]!r}")
        calls.append(ToolCall(m.group(1), _json(args)))
    if body[pos:].strip():
        raise DSMLError(f"unexpected text in tool_calls block: {body[pos:]!r}")
    if not calls:
        raise DSMLError("tool_calls block without invokes")
    return calls
