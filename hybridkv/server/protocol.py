"""OpenAI request schemas and their validation. Every rejection is an `APIError` whose `param`
names the offending field (`messages[2].role`, `tools[0].function.parameters`, `max_tokens`)."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybridkv.chat.dsml import writable_name
from hybridkv.engine.sampling import MAX_STOP_CHARS

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|literal\[.*\]|function-.*|.*\[.*\])$", re.I)


class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-2**63, le=2**64 - 1)     # what torch's generators take
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    ignore_eos: bool = False


class ChatRequest(_Common):
    messages: list[Any] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    chat_template_kwargs: dict | None = None
    thinking: bool | dict | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TYPE_TAG.match(str(part)):
            out += ("." if out else "") + str(part)
    return out


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """JSON bytes -> a validated request, or APIError(400) naming the field."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad("the request body nests JSON arrays or objects too deeply") from None
    if not isinstance(data, dict):
        raise bad(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param(err["loc"])
        raise bad(f"invalid value for '{param}': {err['msg']}", param) from None
    if req.n != 1:
        raise bad("only n=1 is supported", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise bad(f"{name} is not supported (only 0)", name)
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > 16 or any(not s for s in stops):
        raise bad("stop takes at most 16 non-empty strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(f"a stop string has at most {MAX_STOP_CHARS} characters", "stop")
    return req


# ----- chat messages and tools -----
def _text(content: Any, param: str, allow_none: bool = False) -> str | None:
    if content is None:
        if allow_none:
            return None
        raise bad(f"'{param}' is required", param)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad(f"'{param}[{j}]' must be a content part object with a 'type'", f"{param}[{j}]")
            if part["type"] != "text":
                raise bad(f"content parts of type '{part['type']}' are not supported by this model (text only)",
                          f"{param}[{j}].type")
            if not isinstance(part.get("text"), str):
                raise bad(f"'{param}[{j}].text' must be a string", f"{param}[{j}].text")
            parts.append(part["text"])
        return "\n".join(parts)
    raise bad(f"'{param}' must be a string or a list of content parts, got {type(content).__name__}", param)


def _tool_calls(calls: Any, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(f"'{param}' must be a list", param)
    out = []
    for j, c in enumerate(calls):
        p = f"{param}[{j}]"
        if (not isinstance(c, dict) or c.get("type", "function") != "function"
                or not isinstance(c.get("function"), dict)):
            raise bad(f"'{p}' must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", p)
        fn = c["function"]
        if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise bad(f"'{p}.function.name' must be 1-64 letters, digits, '_', '-' or '.'", f"{p}.function.name")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else None
        except ValueError:
            parsed = None
        except RecursionError:
            raise bad(f"'{p}.function.arguments' nests JSON arrays or objects too deeply",
                      f"{p}.function.arguments") from None
        if not isinstance(parsed, dict):
            raise bad(f"'{p}.function.arguments' must be a JSON object encoded as a string", f"{p}.function.arguments")
        for key in parsed:
            if not writable_name(key):
                raise bad(f"'{p}.function.arguments' has an argument named {key!r}: argument names may not hold "
                          "quotes, newlines, angle brackets or the DSML marker", f"{p}.function.arguments")
        out.append({"id": c.get("id") if isinstance(c.get("id"), str) else "", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def normalize_messages(raw: list[Any]) -> list[dict]:
    """OpenAI messages -> the encoder's dicts. Roles: system (and developer, OpenAI's name for it),
    user, assistant, tool."""
    out = []
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{p}' must be an object", p)
        role = m.get("role")
        if role in ("system", "developer"):
            out.append({"role": "system", "content": _text(m.get("content"), f"{p}.content")})
        elif role == "user":
            out.append({"role": "user", "content": _text(m.get("content"), f"{p}.content")})
        elif role == "assistant":
            msg = {"role": "assistant", "content": _text(m.get("content"), f"{p}.content", allow_none=True) or ""}
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise bad(f"'{p}.reasoning_content' must be a string", f"{p}.reasoning_content")
                msg["reasoning_content"] = reasoning
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{p}.tool_calls")
            out.append(msg)
        elif role == "tool":
            if not isinstance(m.get("tool_call_id", ""), str):
                raise bad(f"'{p}.tool_call_id' must be a string", f"{p}.tool_call_id")
            out.append({"role": "tool", "tool_call_id": m.get("tool_call_id", ""),
                        "content": _text(m.get("content"), f"{p}.content")})
        elif isinstance(role, str):
            raise bad(f"unknown role '{role}' in '{p}.role'; use system, user, assistant or tool", f"{p}.role")
        else:
            raise bad(f"'{p}.role' is required and must be a string", f"{p}.role")
    return out


def validate_tools(tools: list[Any]) -> list[dict]:
    if len(tools) > 128:
        raise bad("at most 128 tools", "tools")
    names = set()
    out = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad(f"'{p}' must be {{'type': 'function', 'function': {{...}}}}", p)
        fn = t["function"]
        if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise bad(f"'{p}.function.name' must be 1-64 letters, digits, '_', '-' or '.'", f"{p}.function.name")
        if fn["name"] in names:
            raise bad(f"tool name '{fn['name']}' is given twice", f"{p}.function.name")
        names.add(fn["name"])
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad(f"'{p}.function.description' must be a string", f"{p}.function.description")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad(f"'{p}.function.parameters' must be a JSON Schema object", f"{p}.function.parameters")
            if params.get("type", "object") != "object":
                raise bad(f"'{p}.function.parameters' must describe an object (type 'object')",
                          f"{p}.function.parameters.type")
            if not isinstance(params.get("properties", {}), dict):
                raise bad(f"'{p}.function.parameters.properties' must be an object",
                          f"{p}.function.parameters.properties")
        out.append({"type": "function", "function": fn})
    return out
