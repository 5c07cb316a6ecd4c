"""POST /v1/completions: a text prompt (or token ids) continued, as one JSON object or streamed."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from hybridkv.server.admission import authorize, check_model, check_prompt, prompt_ids, read_request, sampling_params
from hybridkv.server.chat import usage
from hybridkv.server.driver import Output
from hybridkv.server.protocol import CompletionRequest, bad
from hybridkv.server.state import AppState, app_state
from hybridkv.server.streaming import Generation

router = APIRouter(dependencies=[Depends(authorize)])


async def _prompt_ids(st: AppState, req: CompletionRequest) -> list[int]:
    if req.echo or req.suffix or (req.best_of or 1) != 1:
        raise bad("echo, suffix and best_of are not supported", "echo" if req.echo else
                  ("suffix" if req.suffix else "best_of"))
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad("batched prompts are not supported; send one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await prompt_ids(st, prompt, "prompt")
    ids = list(prompt)
    check_prompt(st, ids, "prompt")
    return ids


def _logprobs(tokens: list[str], lps: list[float], top: list[dict], offset: int) -> dict:
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top or None, "text_offset": offsets}


@router.post("/v1/completions")
async def completions(request: Request, st: AppState = Depends(app_state)):
    arrival = time.time()
    req = await read_request(request, st, CompletionRequest)
    check_model(st, req.model)
    ids = await _prompt_ids(st, req)
    params = sampling_params(st, req, req.max_tokens, len(ids), req.logprobs)
    want = req.logprobs is not None
    gen = await Generation.start(st, ids, params, want, "prompt")
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(arrival)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    text_so_far = 0

    def choice(text: str, finish: str | None, lp: dict | None) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": st.config.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}

    def top_of(out: Output) -> list[dict]:
        return [dict(t) for t in out.top_logprobs] if req.logprobs else []

    if req.stream:
        def render(out: Output):
            nonlocal text_so_far
            lp = _logprobs(out.token_texts, out.logprobs, top_of(out), text_so_far) if want else None
            text_so_far += len(out.text)
            if out.text or lp or out.finished:
                c = choice(out.text, out.finish_reason if out.finished else None, lp)
                if include_usage:
                    c["usage"] = None
                yield c
            if out.finished and include_usage:
                c = choice("", None, None)
                c["choices"], c["usage"] = [], usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens,
                                                     speculative=out.speculative)
                yield c
        return gen.stream(render)

    acc = {"text": [], "tokens": [], "lps": [], "top": []}

    def absorb(out: Output) -> None:
        acc["text"].append(out.text)
        acc["tokens"] += out.token_texts
        acc["lps"] += out.logprobs
        acc["top"] += top_of(out)

    out = await gen.collect(request, absorb)
    if out is None:
        return Response(status_code=499)
    body = choice("".join(acc["text"]), out.finish_reason,
                  _logprobs(acc["tokens"], acc["lps"], acc["top"], 0) if want else None)
    body["usage"] = usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens, speculative=out.speculative)
    return body
