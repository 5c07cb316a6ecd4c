"""Split a streamed V4 reply into reasoning, content and tool calls, as it arrives.

In thinking mode the reply starts inside the reasoning block (the prompt ends with `<think>`):
text up to `</think>` is `reasoning_content`, the rest is `content`. When the request offered
tools, a DSML `tool_calls` block in the content is held back, parsed when the reply ends, and
returned as tool calls; a block that does not parse is returned as content, so no text is lost.
Text that might be the start of a marker (`</thi`, `<｜DSML`) is held back until it is decided.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.chat.dsml import CALLS_CLOSE, CALLS_OPEN, DSMLError, ToolCall, parse_tool_calls
from hybridkv.chat.format import THINK_END

REASONING, CONTENT, TOOLS = "reasoning", "content", "tools"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass
class Reply:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class ReplyParser:
    def __init__(self, thinking: bool, tools: bool):
        self.state = REASONING if thinking else CONTENT
        self.tools = tools
        self._buf = ""
        self._block = ""
        self.reply = Reply()

    def _out(self, kind: str, text: str, pieces: list[tuple[str, str]]) -> None:
        if not text:
            return
        if kind == REASONING:
            self.reply.reasoning += text
        else:
            self.reply.content += text
        if pieces and pieces[-1][0] == kind:
            pieces[-1] = (kind, pieces[-1][1] + text)
        else:
            pieces.append((kind, text))

    def feed(self, text: str) -> list[tuple[str, str]]:
        """New text of the reply -> pieces [(kind, text)] that are now certain, kind in
        {"reasoning", "content"}."""
        pieces: list[tuple[str, str]] = []
        self._buf += text
        while self._buf:
            buf = self._buf
            if self.state == REASONING:
                i = buf.find(THINK_END)
                if i >= 0:
                    self._out(REASONING, buf[:i], pieces)
                    self._buf = buf[i + len(THINK_END):]
                    self.state = CONTENT
                    continue
                keep = _partial_suffix(buf, THINK_END)
                self._out(REASONING, buf[:len(buf) - keep], pieces)
                self._buf = buf[len(buf) - keep:]
                break
            if self.state == CONTENT:
                if not self.tools:
                    self._out(CONTENT, buf, pieces)
                    self._buf = ""
                    break
                i = buf.find(CALLS_OPEN)
                if i >= 0:
                    self._out(CONTENT, buf[:i].rstrip(), pieces)
                    self._block, self._buf = buf[i:], ""
                    self.state = TOOLS
                    break
                start = len(buf) - _partial_suffix(buf, CALLS_OPEN)
                while start > 0 and buf[start - 1].isspace():
                    start -= 1
                self._out(CONTENT, buf[:start], pieces)
                self._buf = buf[start:]
                break
            self._block += buf     # TOOLS: everything waits for the end of the reply
            self._buf = ""
        return pieces

    def finish(self) -> list[tuple[str, str]]:
        """The reply ended: the rest of the text, and the tool calls in `reply.tool_calls`."""
        pieces: list[tuple[str, str]] = []
        if self.state == REASONING:
            self._out(REASONING, self._buf, pieces)
        elif self.state == CONTENT:
            self._out(CONTENT, self._buf, pieces)
        else:
            block, trailing = self._block, ""
            end = block.find(CALLS_CLOSE)
            if end >= 0:
                block, trailing = block[:end + len(CALLS_CLOSE)], block[end + len(CALLS_CLOSE):]
            try:
                self.reply.tool_calls = parse_tool_calls(block)
            except DSMLError:
                self._out(CONTENT, ("\n\n" if self.reply.content else "") + self._block, pieces)
                trailing = ""
            if trailing.strip():
                self._out(CONTENT, trailing, pieces)
        self._buf = self._block = ""
        return pieces
