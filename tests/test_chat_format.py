"""The V4 chat format against the official encoder's published cases, and the DSML tool-call
markup and reply parser (encode -> parse back, streamed in pieces)."""

import json

import pytest

from hybridkv.chat.dsml import DSMLError, parse_tool_calls, render_tool_calls
from hybridkv.chat.format import encode_messages
from hybridkv.chat.replies import ReplyParser

CASES = {1: "thinking", 2: "thinking", 3: "thinking", 4: "chat"}


def golden(fixtures, i):
    data = json.loads((fixtures / "chat-encoding" / f"test_input_{i}.json").read_text())
    if isinstance(data, dict):   # case 1: tools given beside the messages, attached to the system message
        messages = data["messages"]
        messages[0]["tools"] = data["tools"]
    else:
        messages = data
    return messages, (fixtures / "chat-encoding" / f"test_output_{i}.txt").read_text()


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_official_encoder(fixtures, case):
    messages, want = golden(fixtures, case)
    assert encode_messages(messages, thinking_mode=CASES[case]) == want


def test_drop_thinking_and_generation_prompt():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "reasoning_content": "r1"}, {"role": "user", "content": "c"}]
    assert encode_messages(msgs, "thinking") == (
        "<｜begin▁of▁sentence｜>S<｜User｜>a<｜Assistant｜></think>b<｜end▁of▁sentence｜><｜User｜>c<｜Assistant｜><think>")
    assert encode_messages(msgs, "thinking", drop_thinking=False) == (
        "<｜begin▁of▁sentence｜>S<｜User｜>a<｜Assistant｜><think>r1</think>b<｜end▁of▁sentence｜>"
        "<｜User｜>c<｜Assistant｜><think>")
    assert encode_messages(msgs, "chat").endswith("<｜User｜>c<｜Assistant｜></think>")
    effort = encode_messages(msgs, "thinking", reasoning_effort="max")
    assert effort.startswith("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum")
    assert not encode_messages(msgs, "chat", reasoning_effort="max").startswith("<｜begin▁of▁sentence｜>Reasoning")


def test_tool_results_follow_call_order_and_join_user_text():
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "b", "content": "B"},
            {"role": "tool", "tool_call_id": "a", "content": "A"},
            {"role": "user", "content": "more"}]
    out = encode_messages(msgs, "chat")
    assert out.endswith("<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nmore"
                        "<｜Assistant｜></think>")
    assert '<｜DSML｜parameter name="x" string="false">1</｜DSML｜parameter>' in out


ARGS = [{"city": "Paris", "days": 3}, {"q": "a \"quoted\" <tag> 中文\nline"}, {},
        {"nested": {"a": [1, 2.5, None, True]}, "flag": False, "s": "5"}]


@pytest.mark.parametrize("args", ARGS, ids=["mixed", "string", "empty", "nested"])
def test_dsml_round_trip(args):
    calls = [{"name": "tool_x", "arguments": json.dumps(args)}, {"name": "other", "arguments": "{\"k\": \"v\"}"}]
    parsed = parse_tool_calls(render_tool_calls(calls))
    assert [c.name for c in parsed] == ["tool_x", "other"]
    assert json.loads(parsed[0].arguments) == args and json.loads(parsed[1].arguments) == {"k": "v"}


@pytest.mark.parametrize("bad", [
    "<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>",
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n",
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"false\">not json"
    "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    "<｜DSML｜tool_calls>\ngarbage\n</｜DSML｜tool_calls>",
])
def test_dsml_rejects_malformed(bad):
    with pytest.raises(DSMLError):
        parse_tool_calls(bad)


def pieces_of(parser, text, step):
    out = []
    for i in range(0, len(text), step):
        out += parser.feed(text[i:i + step])
    out += parser.finish()
    return out


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_reply_parser_splits_reasoning_content_and_tool_calls(fixtures, step):
    # the official case 1: the first assistant turn is a tool call, the last one a plain answer
    messages, prompt = golden(fixtures, 1)
    marker = "<｜Assistant｜><think>"
    first = prompt[prompt.find(marker) + len(marker):prompt.find("<｜end▁of▁sentence｜>", prompt.find(marker))]
    p = ReplyParser(thinking=True, tools=True)
    pieces = pieces_of(p, first, step)
    assert p.reply.reasoning == messages[2]["reasoning_content"] and p.reply.content == ""
    assert [c.name for c in p.reply.tool_calls] == ["get_weather"]
    assert json.loads(p.reply.tool_calls[0].arguments) == {"location": "Beijing", "unit": "celsius"}
    assert "".join(t for k, t in pieces if k == "reasoning") == messages[2]["reasoning_content"]
    last = prompt[prompt.rfind(marker) + len(marker):-len("<｜end▁of▁sentence｜>")]
    p = ReplyParser(thinking=True, tools=True)
    pieces_of(p, last, step)
    assert p.reply.content == messages[4]["content"] and not p.reply.tool_calls


def test_reply_parser_keeps_malformed_block_as_content():
    p = ReplyParser(thinking=False, tools=True)
    text = "Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\nbroken"
    pieces_of(p, text, 2)
    assert not p.reply.tool_calls and p.reply.content == text


def test_reply_parser_without_tools_or_thinking_passes_text_through():
    p = ReplyParser(thinking=False, tools=False)
    text = "a </think> b <｜DSML｜tool_calls> c"
    assert "".join(t for _, t in pieces_of(p, text, 4)) == text
    p = ReplyParser(thinking=True, tools=False)
    pieces_of(p, "only reasoning, cut off </thi", 5)
    assert p.reply.reasoning == "only reasoning, cut off </thi" and p.reply.content == ""
