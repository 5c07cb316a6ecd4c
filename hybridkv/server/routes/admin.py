"""The routes around generation: GET /v1/models, POST /tokenize (the prompt a chat or completion
request becomes, and its token ids), GET /health, GET /metrics (Prometheus), GET /stats (the web
page's JSON: memory, tiers, totals, in-flight) and GET / (the web page)."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from hybridkv.server.admission import authorize, authorize_metrics, check_prompt_chars, read_body
from hybridkv.server.chat import plan_chat_off_loop
from hybridkv.server.protocol import ChatRequest, CompletionRequest, bad, parse_body
from hybridkv.server.state import AppState, app_state

STATIC = Path(__file__).resolve().parent.parent / "static"

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(st: AppState = Depends(app_state)):
    if not st.driver.alive:
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return {"status": "ok"}


@router.get("/v1/models", dependencies=[Depends(authorize)])
async def models(st: AppState = Depends(app_state)):
    return {"object": "list", "data": [{"id": st.config.model_name, "object": "model", "created": st.created,
                                        "owned_by": "hybridkv", "max_model_len": st.max_model_len}]}


@router.get("/metrics", dependencies=[Depends(authorize_metrics)])
async def prometheus(st: AppState = Depends(app_state)):
    return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/stats", dependencies=[Depends(authorize_metrics)])
async def stats(st: AppState = Depends(app_state)):
    d = st.driver
    return {"model": st.config.model_name, "memory": d.snapshot, "totals": st.metrics.totals(),
            "inflight": st.inflight, "max_inflight": st.max_inflight, "engine_alive": d.alive,
            "failed_steps": d.steps_failed}


@router.get("/")
async def index():
    return FileResponse(STATIC / "index.html")


@router.post("/tokenize", dependencies=[Depends(authorize)])
async def tokenize(request: Request, st: AppState = Depends(app_state)):
    raw = await read_body(request, st)
    try:
        is_chat = "messages" in await run_in_threadpool(json.loads, raw)
    except (ValueError, TypeError, RecursionError):
        is_chat = False     # parse_body names the problem
    if is_chat:
        plan = await plan_chat_off_loop(await run_in_threadpool(parse_body, raw, ChatRequest),
                                        st.config.default_thinking)
        prompt = plan.prompt
        check_prompt_chars(st, sum(len(text) for text, _ in plan.segments), "messages")
        ids = await run_in_threadpool(st.tokenizer.encode_segments, plan.segments)
    else:
        req = await run_in_threadpool(parse_body, raw, CompletionRequest)
        if not isinstance(req.prompt, str):
            raise bad("prompt must be a string here", "prompt")
        prompt = req.prompt
        check_prompt_chars(st, len(prompt), "prompt")
        ids = await run_in_threadpool(st.tokenizer.encode, prompt)
    return {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids, "prompt": prompt}
