"""DSML, the V4 tool-call markup: render OpenAI tool calls into it, and parse it back.

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

String arguments are written as they are (`string="true"`); every other JSON value is written
as JSON (`string="false"`). Arguments that are not a JSON object are passed as one string
parameter named `arguments`.
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
    """A DSML block that does not parse."""


@dataclass
class ToolCall:
    name: str
    arguments: str          # a JSON object, as text


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except UnicodeEncodeError:
        return json.dumps(value, ensure_ascii=True)


def render_arguments(arguments: str) -> str:
    try:
        values = json.loads(arguments)
    except (TypeError, ValueError):
        values = {"arguments": arguments}
    if not isinstance(values, dict):
        values = {"arguments": arguments}
    lines = []
    for key, value in values.items():
        is_str = isinstance(value, str)
        text = value if is_str else _json(value)
        lines.append(f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">{text}</{DSML}parameter>')
    return "\n".join(lines)


def render_tool_calls(calls: list[dict]) -> str:
    """The DSML block of calls given as {"name": ..., "arguments": "<json object>"}."""
    invokes = [f'<{DSML}invoke name="{c["name"]}">\n{render_arguments(c.get("arguments") or "{}")}\n</{DSML}invoke>'
               for c in calls]
    return f"{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


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
