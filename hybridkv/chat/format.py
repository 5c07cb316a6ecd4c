"""The DeepSeek-V4 chat format: OpenAI-style messages -> one prompt string.

Layout (see the official encoder's documentation for the full description):

    <BOS>{system}[\\n\\n## Tools ...]<｜User｜>{user}<｜Assistant｜></think>{reply}<EOS><｜User｜>...

- Thinking mode opens the reply with `<think>` instead of closing it with `</think>`; assistant
  turns render as `{reasoning}</think>{content}` when their reasoning is kept. Without tools,
  turns before the last user message lose their reasoning (`drop_thinking`).
- Tool definitions render after the system (or developer) content; tool calls render as a DSML
  block after the assistant's content (see dsml.py); `tool` messages become `<tool_result>`
  blocks inside a user turn, ordered like the calls they answer.
- `reasoning_effort="max"` puts a fixed instruction before everything in thinking mode.

Messages are plain dicts (the OpenAI wire shape plus `reasoning_content`, and the internal
fields `task`, `wo_eos` and `content_blocks`). `encode_messages` reproduces the official encoder
byte for byte on its published test cases.

`render_segments` gives the same prompt as segments `(text, trusted)`: the template's text
(trusted: the only place special tokens may come from) and the messages' content (not trusted:
tokenised as plain text, so a message that spells `<｜User｜>` cannot forge a turn; see
`hybridkv.engine.tokenizer.Tokenizer.encode_segments`).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hybridkv.chat.dsml import DSML, Parts, tool_call_parts

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
TASK_TOKENS = {name: f"<｜{name}｜>" for name in ("action", "query", "authority", "domain", "title", "read_url")}
THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = (None, "high", "max")

SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START, THINK_END, DSML, *TASK_TOKENS.values())

MAX_EFFORT_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

_TOOLS_HEADER = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f"\"<{DSML}tool_calls>\" block like the following:\n\n"
    f"<{DSML}tool_calls>\n"
    f"<{DSML}invoke name=\"$TOOL_NAME\">\n"
    f"<{DSML}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{DSML}parameter>\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f"<{DSML}invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside "
    f"{THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_FOOTER = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


def to_json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except UnicodeEncodeError:   # lone surrogates
        return json.dumps(value, ensure_ascii=True)


def _tools_parts(tools: list[dict]) -> Parts:
    parts: Parts = [(_TOOLS_HEADER, True)]
    for i, t in enumerate(tools):
        parts += [("\n" if i else "", True), (to_json(t["function"]), False)]
    return parts + [(_TOOLS_FOOTER, True)]


def render_tools(tools: list[dict]) -> str:
    """The tools section: OpenAI `tools` entries ({"type": "function", "function": {...}})."""
    return "".join(text for text, _ in _tools_parts(tools))


def _response_format_parts(schema: Any) -> Parts:
    return [("## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n", True),
            (to_json(schema), False)]


def _text_of_tool_content(content: Any) -> str:
    if isinstance(content, list):
        return "\n\n".join(b.get("text", "") if b.get("type") == "text" else f"[Unsupported {b.get('type')}]"
                           for b in content)
    return content if content is not None else ""


# ----- preprocessing -----
def _merge_tool_messages(messages: list[dict]) -> list[dict]:
    """`tool` messages become tool_result blocks of a user turn; a user message that follows such a
    turn (or another user message) joins it as a text block."""
    out: list[dict] = []
    for msg in messages:
        msg = copy.deepcopy(msg)
        role = msg.get("role")
        prev = out[-1] if out else None
        joinable = prev is not None and prev.get("role") == "user" and "content_blocks" in prev
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""),
                     "content": msg.get("content", "")}
            if joinable:
                prev["content_blocks"].append(block)
            else:
                out.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": msg.get("content", "")}
            if joinable and prev.get("task") is None:
                prev["content_blocks"].append(block)
            else:
                merged = {"role": "user", "content": msg.get("content", ""), "content_blocks": [block]}
                merged.update({k: msg[k] for k in ("task", "wo_eos", "mask") if k in msg})
                out.append(merged)
        else:
            out.append(msg)
    return out


def _sort_tool_results(messages: list[dict]) -> list[dict]:
    """Tool results in the order of the calls of the assistant turn before them."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {}
            for i, call in enumerate(msg["tool_calls"]):
                call_id = call.get("id") or call.get("function", {}).get("id", "")
                if call_id:
                    order[call_id] = i
        elif msg.get("role") == "user" and msg.get("content_blocks") and order:
            blocks = msg["content_blocks"]
            results = [b for b in blocks if b.get("type") == "tool_result"]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
                msg["content_blocks"] = [next(ranked) if b.get("type") == "tool_result" else b for b in blocks]
    return messages


def _last_user_index(messages: list[dict]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in ("user", "developer"):
            return i
    return -1


def _drop_old_thinking(messages: list[dict]) -> list[dict]:
    """Before the last user turn: assistant turns lose their reasoning, developer turns go away."""
    last_user = _last_user_index(messages)
    kept = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if i >= last_user or role in ("user", "system", "tool", "latest_reminder", "direct_search_results"):
            kept.append(msg)
        elif role == "assistant":
            kept.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return kept


# ----- rendering -----
def _render(i: int, messages: list[dict], thinking: bool, drop_thinking: bool, effort: str | None,
            last_user: int) -> Parts:
    """Message i's segments; last_user: `_last_user_index(messages)` (found once for the conversation)."""
    msg = messages[i]
    role = msg.get("role")
    content = msg.get("content")
    out: Parts = [(MAX_EFFORT_PREFIX, True)] if (i == 0 and thinking and effort == "max") else []

    def text(value: Any) -> None:     # the caller's content
        out.append((value or "", False))

    if role in ("system", "developer"):
        if role == "developer":
            if not content:
                raise ValueError("a developer message needs content")
            out.append((USER, True))
        text(content)
        if msg.get("tools"):
            out.append(("\n\n", True))
            out.extend(_tools_parts(msg["tools"]))
        if msg.get("response_format"):
            out.append(("\n\n", True))
            out.extend(_response_format_parts(msg["response_format"]))
    elif role == "user":
        out.append((USER, True))
        blocks = msg.get("content_blocks")
        if blocks:
            for j, b in enumerate(blocks):
                if j:
                    out.append(("\n\n", True))
                kind = b.get("type")
                if kind == "text":
                    text(b.get("text", ""))
                elif kind == "tool_result":
                    out.append(("<tool_result>", True))
                    text(_text_of_tool_content(b.get("content", "")))
                    out.append(("</tool_result>", True))
                else:
                    text(f"[Unsupported {kind}]")
        else:
            text(content)
    elif role == "latest_reminder":
        out.append((LATEST_REMINDER, True))
        text(content)
    elif role == "assistant":
        after_task = i > 0 and messages[i - 1].get("task") is not None
        if thinking and not after_task and (not drop_thinking or i > last_user):
            text(msg.get("reasoning_content"))
            out.append((THINK_END, True))
        text(content)
        calls = msg.get("tool_calls")
        if calls:
            out.append(("\n\n", True))
            out.extend(tool_call_parts([c["function"] for c in calls]))
        if not msg.get("wo_eos", False):
            out.append((EOS, True))
    elif role == "tool":
        raise ValueError("tool messages must be merged into user turns first")
    else:
        raise ValueError(f"unknown role {role!r}")

    # what follows the message: the next message itself, or the opening of a reply
    if i + 1 < len(messages) and messages[i + 1].get("role") not in ("assistant", "latest_reminder"):
        return out
    task = msg.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise ValueError(f"unknown task {task!r}; one of {', '.join(TASK_TOKENS)}")
        if task == "action":
            out += [(ASSISTANT, True), (THINK_START if thinking else THINK_END, True), (TASK_TOKENS[task], True)]
        else:
            out.append((TASK_TOKENS[task], True))
    elif role in ("user", "developer"):
        opens_thinking = thinking and (not drop_thinking or i >= last_user)
        out += [(ASSISTANT, True), (THINK_START if opens_thinking else THINK_END, True)]
    return out


def render_segments(messages: list[dict], thinking_mode: str = "chat", drop_thinking: bool = True,
                    reasoning_effort: str | None = None, add_bos: bool = True) -> Parts:
    """The prompt for `messages` as `(text, trusted)` segments, in order: the template's text is
    trusted, the messages' content is not. Joined, they are `encode_messages`' string."""
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    msgs = _sort_tool_results(_merge_tool_messages(messages))
    thinking = thinking_mode == "thinking"
    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking and drop:
        msgs = _drop_old_thinking(msgs)
    parts: Parts = [(BOS, True)] if add_bos else []
    last_user = _last_user_index(msgs)
    for i in range(len(msgs)):
        parts.extend(_render(i, msgs, thinking, drop, reasoning_effort, last_user))
    return [(t, trusted) for t, trusted in parts if t]


def encode_messages(messages: list[dict], thinking_mode: str = "chat", drop_thinking: bool = True,
                    reasoning_effort: str | None = None, add_bos: bool = True) -> str:
    """The prompt for `messages` (roles system, developer, user, assistant, tool, latest_reminder).
    A conversation that ends with a user or tool turn ends with the opening of the reply."""
    return "".join(t for t, _ in render_segments(messages, thinking_mode, drop_thinking, reasoning_effort, add_bos))
