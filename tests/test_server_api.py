"""The server against the official `openai` client and plain HTTP: streaming, usage with cached
tokens, a tool-call round trip, thinking mode, logprobs, completions, metrics, disconnects and
engine failures (the random tiny model replies gibberish: these tests check the protocol)."""

import json
import time

import httpx
import pytest
from openai import OpenAI

from hybridkv.chat.format import encode_messages

LONG = " ".join(f"fact {i} is that the quick brown fox jumps over the lazy dog" for i in range(30))


@pytest.fixture(scope="module")
def client(live_server):
    return OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_and_health(live_server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(live_server.url + "/health").json() == {"status": "ok"}


def test_streaming_chat_with_usage(live_server, client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=6, stream=True, stream_options={"include_usage": True}, temperature=0.0)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 6
    assert usage.prompt_tokens_details.cached_tokens == 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # the same request, not streamed, greedy: the same text
    full = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=6, temperature=0.0)
    assert full.choices[0].message.content == text
    assert full.usage.prompt_tokens == usage.prompt_tokens
    live_server.wait_idle()


def test_sse_wire_format_ends_with_done(live_server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", live_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    json.loads(lines[-2][6:])


def test_cached_tokens_on_repeated_prefix(live_server, client):
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": "Summarise."}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    n = first.usage.prompt_tokens
    assert n > 256 and first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (n - 1) // 128 * 128 and cached >= 256          # every complete block but the last token's
    salted = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                            extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0     # another tenant does not see the prefix
    metrics = {ln.split()[0]: float(ln.split()[1]) for ln in httpx.get(live_server.url + "/metrics").text.splitlines()
               if ln.startswith("vllm:prefix_cache")}
    assert metrics['vllm:prefix_cache_hits_total{model_name="tiny"}'] >= cached
    assert metrics['vllm:prefix_cache_queries_total{model_name="tiny"}'] >= 3 * n
    live_server.wait_idle()


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


def test_tool_call_round_trip(live_server, client):
    call_text = ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                 "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
                 "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
                 "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    live_server.script("TOOLTEST weather", call_text)
    messages = [{"role": "user", "content": "TOOLTEST weather in Paris?"}]
    stream = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=80, stream=True)
    chunks = list(stream)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""     # the markup never leaks as text
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    # non-streamed, the same reply becomes message.tool_calls
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=80)
    msg = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls[0].function.name == "get_weather"
    # the client runs the tool and sends the result back: the next prompt holds the call and the result
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": msg.tool_calls[0].id, "type": "function",
         "function": {"name": "get_weather", "arguments": msg.tool_calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "{\"temp\": 21}"}]
    tok = httpx.post(live_server.url + "/tokenize", json={"messages": follow, "tools": TOOLS}).json()
    expected = encode_messages([{"role": "system", "content": "", "tools": TOOLS}] + [
        {k: v for k, v in m.items() if v is not None} for m in follow], "chat")
    assert tok["prompt"] == expected
    assert tok["prompt"].endswith(call_text + "<｜end▁of▁sentence｜><｜User｜><tool_result>{\"temp\": 21}</tool_result>"
                                  "<｜Assistant｜></think>")
    final = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=3)
    assert final.usage.prompt_tokens == tok["count"]
    live_server.wait_idle()


def test_thinking_mode_splits_reasoning(live_server, client):
    live_server.script("THINKTEST", "Let me think.</think>The answer.")
    messages = [{"role": "user", "content": "THINKTEST 2+2?"}]
    for extra in ({"chat_template_kwargs": {"thinking": True}}, {"thinking": {"type": "enabled"}},
                  {"reasoning_effort": "high"}):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, extra_body=extra)
        msg = r.choices[0].message
        assert msg.content == "The answer." and msg.model_extra["reasoning_content"] == "Let me think."
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens_details.reasoning_tokens > 0
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, stream=True,
                                                 extra_body={"chat_template_kwargs": {"thinking": True}}))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == ("Let me think.", "The answer.")
    tok = httpx.post(live_server.url + "/tokenize", json={"messages": messages, "reasoning_effort": "max"}).json()
    assert tok["prompt"].startswith("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum")
    assert tok["prompt"].endswith("<｜Assistant｜><think>")


def test_logprobs_seed_and_stop(live_server, client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       logprobs=True, top_logprobs=3, temperature=0.0)
    lp = r.choices[0].logprobs.content
    assert len(lp) == 4 and all(len(t.top_logprobs) == 3 for t in lp)
    assert lp[0].top_logprobs[0].logprob == pytest.approx(lp[0].logprob)
    a, b = (client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                           temperature=1.0, seed=7).choices[0].message.content for _ in range(2))
    assert a == b
    live_server.script("STOPTEST", "alpha beta gamma")
    s = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "STOPTEST"}],
                                       max_tokens=20, stop=["gam"])
    assert s.choices[0].message.content == "alpha beta " and s.choices[0].finish_reason == "stop"


def test_completions(live_server, client):
    r = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=5, logprobs=2, temperature=0)
    assert r.usage.completion_tokens == 5 and len(r.choices[0].logprobs.tokens) == 5
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4 and ids.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.completions.create(model="tiny", prompt="The quick brown", max_tokens=5, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_metrics_use_vllm_names(live_server, client):
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    text = httpx.get(live_server.url + "/metrics").text
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:request_success_total",
                 'hybridkv:kv_cache_bytes{kind="CSA main",model_name="tiny",state="active",tier="device"}',
                 'hybridkv:kv_cache_capacity_bytes{kind="window",model_name="tiny",tier="device"}'):
        assert name in text, name


def test_client_disconnect_aborts_and_frees_blocks(live_server):
    body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2000, "stream": True,
            "ignore_eos": True}         # a random-weight model may emit EOS within 2000 tokens
    with httpx.stream("POST", live_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()        # keep the iterator: dropping it would close the connection
        seen = [ln for ln in (next(lines) for _ in range(8)) if ln.startswith("data: ")]
        assert '"finish_reason": null' in seen[-1], seen
        deadline = time.time() + 5          # the memory snapshot is refreshed every 0.2 s
        while live_server.stats()["memory"]["blocks"]["active"] == 0:
            assert time.time() < deadline, "the running request holds no block"
            time.sleep(0.02)
        assert live_server.stats()["inflight"] == 1
        r.close()                     # the client goes away mid-stream
    t0 = time.time()
    idle = live_server.wait_idle(timeout=5)
    print(f"blocks freed {time.time() - t0:.3f}s after the disconnect")
    assert idle["totals"]["generation_tokens"] > 0
    aborted = [ln for ln in httpx.get(live_server.url + "/metrics").text.splitlines()
               if ln.startswith('vllm:request_success_total{finished_reason="abort"')]
    assert aborted and float(aborted[0].split()[-1]) >= 1
    live_server.engine.store.pool.check()


def test_engine_failure_fails_only_that_request(live_server, client):
    live_server.fail_marker = "CRASHME"
    try:
        r = httpx.post(live_server.url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "CRASHME now"}], "max_tokens": 4})
        assert r.status_code == 500 and "injected engine failure" in r.json()["error"]["message"]
        with httpx.stream("POST", live_server.url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "CRASHME again"}], "max_tokens": 4, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln]
        assert any('"error"' in ln for ln in lines) and lines[-1] == "data: [DONE]"
    finally:
        live_server.fail_marker = None
    ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "fine"}], max_tokens=3)
    assert ok.usage.completion_tokens == 3
    assert httpx.get(live_server.url + "/health").status_code == 200
    live_server.wait_idle()
    live_server.engine.store.pool.check()


def test_non_streaming_disconnect_aborts(live_server):
    body = {"messages": [{"role": "user", "content": "long answer please"}], "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    live_server.wait_idle(timeout=5)
    live_server.engine.store.pool.check()


def test_streamed_text_never_splits_a_character(live_server, client):
    live_server.script("UTFTEST", "温泉 ok ü")
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "UTFTEST"}],
                                                 max_tokens=30, stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == "温泉 ok ü" and not any("\ufffd" in p for p in pieces)
    assert len(live_server.server.tokenizer.encode("温")) > 1      # the character really spans several tokens
