"""POST /v1/chat/completions: messages in the V4 chat format; the reply split into reasoning,
content and DSML tool calls; as one JSON object or streamed."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from hybridkv.server.admission import authorize, chat_prompt_ids, check_model, read_request, sampling_params
from hybridkv.server.chat import plan_chat_off_loop, token_logprobs, tool_call_objects, usage
from hybridkv.server.driver import Output
from hybridkv.server.protocol import ChatRequest, bad
from hybridkv.chat.replies import REASONING, ReplyParser
from hybridkv.server.state import AppState, app_state
from hybridkv.server.streaming import Generation

router = APIRouter(dependencies=[Depends(authorize)])


class _Reply:
    """The reply as it comes out: parsed text pieces, logprobs and reasoning tokens."""

    def __init__(self, req: ChatRequest, thinking: bool, parse_tools: bool):
        self.req, self.thinking = req, thinking
        self.parser = ReplyParser(thinking, parse_tools)
        self.reasoning_tokens = 0
        self.logprobs: list[dict] = []

    def absorb(self, out: Output) -> tuple[list[tuple[str, str]], list[dict]]:
        """(the pieces of text this output completes, its logprob entries)."""
        if self.parser.state == REASONING:
            self.reasoning_tokens += len(out.token_ids)
        pieces = self.parser.feed(out.text) + (self.parser.finish() if out.finished else [])
        lps = token_logprobs(out.token_texts, out.logprobs, out.top_logprobs) if self.req.logprobs else []
        self.logprobs += lps
        return pieces, lps

    def usage(self, out: Output) -> dict:
        return usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens,
                     self.reasoning_tokens if self.thinking else 0, out.speculative)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, st: AppState = Depends(app_state)):
    arrival = time.time()
    req = await read_request(request, st, ChatRequest)
    check_model(st, req.model)
    plan = await plan_chat_off_loop(req, st.config.default_thinking)
    ids = await chat_prompt_ids(st, plan.segments, "messages")
    if req.top_logprobs and not req.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    params = sampling_params(st, req, req.max_completion_tokens or req.max_tokens, len(ids),
                             req.top_logprobs if req.logprobs else None)
    gen = await Generation.start(st, ids, params, req.logprobs, "messages")
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(arrival)
    reply = _Reply(req, plan.thinking, plan.parse_tools)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": st.config.model_name,
             "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            c["usage"] = None
        return c

    if req.stream:
        def render(out: Output):
            pieces, lps = reply.absorb(out)
            lp = {"content": lps} if req.logprobs else None
            for kind, text in pieces:
                yield chunk({"reasoning_content" if kind == REASONING else "content": text}, logprobs=lp)
                lp = None
            if lp and lp["content"]:
                yield chunk({}, logprobs=lp)
            if out.finished:
                calls = reply.parser.reply.tool_calls
                if calls:
                    yield chunk({"tool_calls": tool_call_objects(calls, streaming=True)})
                yield chunk({}, finish="tool_calls" if calls else out.finish_reason)
                if include_usage:
                    c = chunk({})
                    c["choices"], c["usage"] = [], reply.usage(out)
                    yield c
        return gen.stream(render, first=[chunk({"role": "assistant", "content": ""})])

    out = await gen.collect(request, reply.absorb)
    if out is None:
        return Response(status_code=499)
    parsed = reply.parser.reply
    message = {"role": "assistant", "content": parsed.content if (parsed.content or not parsed.tool_calls) else None,
               "reasoning_content": parsed.reasoning if plan.thinking else None}
    if parsed.tool_calls:
        message["tool_calls"] = tool_call_objects(parsed.tool_calls, streaming=False)
    return {"id": rid, "object": "chat.completion", "created": created, "model": st.config.model_name,
            "choices": [{"index": 0, "message": message,
                         "logprobs": {"content": reply.logprobs} if req.logprobs else None,
                         "finish_reason": "tool_calls" if parsed.tool_calls else out.finish_reason}],
            "usage": reply.usage(out)}
