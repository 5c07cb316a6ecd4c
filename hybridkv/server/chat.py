"""From a validated chat request to a V4 prompt (thinking mode, reasoning effort, tools), and from
the engine's outputs to OpenAI chat objects (message, stream chunks, logprobs, usage)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from hybridkv.chat.dsml import ToolCall
from hybridkv.chat.format import render_segments
from hybridkv.server.protocol import ChatRequest, bad, normalize_messages, validate_tools

EFFORT_TO_ENCODER = {"high": "high", "xhigh": "high", "max": "max"}


@dataclass
class ChatPlan:
    segments: list[tuple[str, bool]]    # the prompt as (text, trusted): Tokenizer.encode_segments
    thinking: bool           # the reply starts inside <think>
    parse_tools: bool

    @property
    def prompt(self) -> str:
        return "".join(text for text, _ in self.segments)


def _flag(value, param: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, dict) and value.get("type") in ("enabled", "disabled"):
        return value["type"] == "enabled"
    raise bad(f"'{param}' must be true/false or {{\"type\": \"enabled\"|\"disabled\"}}", param)


def thinking_of(req: ChatRequest, default: bool) -> tuple[bool, str | None, bool]:
    """(thinking, encoder reasoning effort, drop_thinking). An explicit `thinking` field or
    chat_template_kwargs (`thinking`, `enable_thinking`, `thinking_mode`) decides; otherwise a
    reasoning_effort other than none/minimal turns thinking on."""
    kw = req.chat_template_kwargs or {}
    explicit = None
    if req.thinking is not None:
        explicit = _flag(req.thinking, "thinking")
    for key in ("thinking", "enable_thinking"):
        if key in kw:
            explicit = _flag(kw[key], f"chat_template_kwargs.{key}")
    if "thinking_mode" in kw:
        if kw["thinking_mode"] not in ("chat", "thinking"):
            raise bad("chat_template_kwargs.thinking_mode must be 'chat' or 'thinking'",
                      "chat_template_kwargs.thinking_mode")
        explicit = kw["thinking_mode"] == "thinking"
    effort = req.reasoning_effort or kw.get("reasoning_effort")
    if effort is not None and effort not in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        raise bad("reasoning_effort must be one of none, minimal, low, medium, high, xhigh, max",
                  "chat_template_kwargs.reasoning_effort")
    thinking = explicit if explicit is not None else (default if effort is None else effort not in ("none", "minimal"))
    drop = kw.get("drop_thinking", True)
    if not isinstance(drop, bool):
        raise bad("chat_template_kwargs.drop_thinking must be true or false", "chat_template_kwargs.drop_thinking")
    return thinking, EFFORT_TO_ENCODER.get(effort) if thinking else None, drop


def plan_chat(req: ChatRequest, default_thinking: bool) -> ChatPlan:
    messages = normalize_messages(req.messages)
    tools = validate_tools(req.tools) if req.tools else []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice not in ("none", "auto"):
        if choice == "required" or isinstance(choice, dict):
            raise bad("tool_choice 'required' and named functions are not supported (this server does not "
                      "constrain decoding); use 'auto' or 'none'", "tool_choice")
        raise bad(f"tool_choice must be 'none' or 'auto', got {choice!r}", "tool_choice")
    thinking, effort, drop = thinking_of(req, default_thinking)
    extras = {}
    if tools and choice == "auto":
        extras["tools"] = tools
    rf = req.response_format
    if rf is not None:
        if rf.get("type") not in ("text", "json_object", "json_schema"):
            raise bad("response_format.type must be text, json_object or json_schema", "response_format.type")
        if rf["type"] != "text":
            extras["response_format"] = rf   # rendered into the system prompt (not enforced)
    if extras:
        if messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": ""})
        messages[0].update(extras)
    continues = messages[-1]["role"] == "assistant"
    if continues:
        messages[-1]["wo_eos"] = True     # continue the last assistant message (prefix completion)
    segments = render_segments(messages, "thinking" if thinking else "chat", drop_thinking=drop,
                               reasoning_effort=effort)
    return ChatPlan(segments, thinking and not continues, bool(extras.get("tools")))


async def plan_chat_off_loop(req: ChatRequest, default_thinking: bool) -> ChatPlan:
    """`plan_chat` in a worker thread, so that rendering a long conversation never stalls the event loop
    (and every other request with it); a tool schema or response_format nested too deeply to copy is
    the request's error (400), not the server's."""
    try:
        return await run_in_threadpool(plan_chat, req, default_thinking)
    except RecursionError:
        raise bad("a tool's parameters or the response_format nest JSON arrays or objects too deeply") from None


# ----- responses -----
def tool_call_objects(calls: list[ToolCall], streaming: bool) -> list[dict]:
    out = []
    for i, c in enumerate(calls):
        obj = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": c.name, "arguments": c.arguments}}
        if streaming:
            obj["index"] = i
        out.append(obj)
    return out


def token_logprobs(token_texts, logprobs, top) -> list[dict]:
    out = []
    for i, (t, lp) in enumerate(zip(token_texts, logprobs, strict=True)):
        entry = {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
        if top:
            entry["top_logprobs"] = [{"token": tt, "logprob": tlp, "bytes": list(tt.encode("utf-8"))}
                                     for tt, tlp in top[i]]
        out.append(entry)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached: int, reasoning_tokens: int | None = None,
          speculative: tuple[int, int, int] | None = None) -> dict:
    """OpenAI's usage object. With speculative decoding, (verify steps, draft tokens, accepted drafts)
    go where OpenAI reports predicted outputs (completion_tokens_details.accepted_prediction_tokens /
    rejected_prediction_tokens), with the steps and mean acceptance length under "speculative_decoding"."""
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached},
         "prompt_cache_hit_tokens": cached, "prompt_cache_miss_tokens": prompt_tokens - cached}
    details = {}
    if reasoning_tokens is not None:
        details["reasoning_tokens"] = reasoning_tokens
    if speculative is not None:
        steps, drafted, accepted = speculative
        details.update(accepted_prediction_tokens=accepted, rejected_prediction_tokens=drafted - accepted)
        u["speculative_decoding"] = {"num_drafts": steps, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                                     "mean_acceptance_length": 1 + accepted / steps if steps else None}
    if details:
        u["completion_tokens_details"] = details
    return u
