"""Bad input, each answered 4xx with an OpenAI error object that names the problem, the server
healthy afterwards; the bearer key; the queue limit (429 + Retry-After)."""

import json
import time

import httpx
import pytest

KEY = "test-key-123"
OK_MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def strict():
    from serverkit import LiveServer

    server = LiveServer(api_key=KEY, max_num_seqs=1, max_queued=1, max_body_bytes=64 * 1024,
                        max_prompt_tokens=300, max_tokens_limit=512, max_model_len=512)
    yield server
    server.close()


def chat(**fields):
    return {"messages": OK_MSG, "max_tokens": 2, **fields}


CASES = [
    # (id, path, body (dict or raw bytes), headers override, status, param, words in the message)
    ("malformed-json", "/v1/chat/completions", b'{"messages": [', None, 400, None, "not valid JSON"),
    ("body-not-object", "/v1/chat/completions", b"[1, 2]", None, 400, None, "JSON object"),
    ("messages-wrong-type", "/v1/chat/completions", {"messages": "hi"}, None, 400, "messages", "valid list"),
    ("messages-empty", "/v1/chat/completions", {"messages": []}, None, 400, "messages", "at least 1"),
    ("messages-missing", "/v1/chat/completions", {"max_tokens": 2}, None, 400, "messages", "required"),
    ("unknown-role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400,
     "messages[0].role", "unknown role 'wizard'"),
    ("missing-role", "/v1/chat/completions", {"messages": [{"content": "x"}]}, None, 400, "messages[0].role",
     "required"),
    ("content-wrong-type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None, 400,
     "messages[0].content", "string or a list"),
    ("image-part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, None, 400, "messages[0].content[0].type",
     "not supported"),
    ("max-tokens-negative", "/v1/chat/completions", chat(max_tokens=-1), None, 400, "max_tokens", "greater than"),
    ("max-tokens-huge", "/v1/chat/completions", chat(max_tokens=10 ** 9), None, 400, "max_tokens", "at most 512"),
    ("max-tokens-string", "/v1/chat/completions", chat(max_tokens="5"), None, 400, "max_tokens", "valid integer"),
    ("temperature-range", "/v1/chat/completions", chat(temperature=5), None, 400, "temperature", "less than"),
    ("top-p-zero", "/v1/chat/completions", chat(top_p=0), None, 400, "top_p", "greater than"),
    ("stream-not-bool", "/v1/chat/completions", chat(stream="yes"), None, 400, "stream", "valid boolean"),
    ("n-two", "/v1/chat/completions", chat(n=2), None, 400, "n", "n=1"),
    ("top-logprobs-range", "/v1/chat/completions", chat(logprobs=True, top_logprobs=50), None, 400, "top_logprobs",
     "less than"),
    ("prompt-over-limit", "/v1/chat/completions", {"messages": [{"role": "user", "content": "fox " * 400}]}, None, 400,
     "messages", "at most 300"),
    ("tool-schema-not-object", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": "a string"}}]), None, 400, "tools[0].function.parameters", "JSON Schema"),
    ("tool-bad-name", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "no spaces"}}]),
     None, 400, "tools[0].function.name", "letters"),
    ("tool-wrong-type", "/v1/chat/completions", chat(tools=[{"type": "retrieval"}]), None, 400, "tools[0]",
     "'type': 'function'"),
    ("tool-choice-required", "/v1/chat/completions", chat(tools=[TOOL], tool_choice="required"), None, 400,
     "tool_choice", "not supported"),
    ("tool-call-arguments", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                              "function": {"name": "f", "arguments": "{not json"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "r"}]}, None, 400,
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    ("thinking-flag-type", "/v1/chat/completions", chat(chat_template_kwargs={"thinking": "yes"}), None, 400,
     "chat_template_kwargs.thinking", "true/false"),
    ("stop-too-many", "/v1/chat/completions", chat(stop=[f"s{i}" for i in range(20)]), None, 400, "stop",
     "at most 16"),
    ("stop-too-long", "/v1/chat/completions", chat(stop=["x" * 1025]), None, 400, "stop", "at most 1024 characters"),
    ("top-k-huge", "/v1/chat/completions", chat(top_k=10 ** 400), None, 400, None, "top_k must be between 0 and"),
    ("model-lone-surrogate", "/v1/chat/completions", json.dumps(chat(model="\ud800")).encode(), None, 404, "model",
     "does not exist"),
    ("tokenize-over-limit", "/tokenize", {"prompt": "x" * 60_000}, None, 400, "prompt", "characters"),
    ("context-overflow", "/v1/chat/completions", {"messages": OK_MSG, "max_tokens": 510}, None, 400, "max_tokens",
     "exceeds the context length 512"),
    ("unknown-model", "/v1/chat/completions", chat(model="gpt-9"), None, 404, "model", "does not exist"),
    ("bad-api-key", "/v1/chat/completions", chat(), {"Authorization": "Bearer wrong"}, 401, None, "API key"),
    ("missing-api-key", "/v1/chat/completions", chat(), {}, 401, None, "API key"),
    ("oversized-body", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 70_000}]}, None, 413,
     None, "limit is 65536"),
    ("completion-token-out-of-vocab", "/v1/completions", {"prompt": [5, 99999], "max_tokens": 2}, None, 400,
     "prompt", "must be in [0, 512)"),
    ("completion-prompt-type", "/v1/completions", {"prompt": 5}, None, 400, "prompt", "valid"),
    ("completion-batched", "/v1/completions", {"prompt": ["a", "b"]}, None, 400, "prompt", "one prompt"),
    ("models-without-key", "/v1/models", None, {}, 401, None, "API key"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(strict, case):
    _, path, body, headers, status, param, words = case
    h = {"Authorization": f"Bearer {KEY}"} if headers is None else headers
    if body is None:
        r = httpx.get(strict.url + path, headers=h, timeout=30)
    elif isinstance(body, bytes):
        r = httpx.post(strict.url + path, content=body, headers={**h, "Content-Type": "application/json"}, timeout=30)
    else:
        r = httpx.post(strict.url + path, json=body, headers=h, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if words is not None:
        assert words in err["message"], err


def test_unknown_route_and_method(strict):
    r = httpx.get(strict.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(strict.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and "error" in r.json()


def test_chunked_oversized_body(strict):
    def gen():
        for _ in range(20):
            yield b"x" * 8192
    r = httpx.post(strict.url + "/v1/chat/completions", content=gen(), headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413 and "exceeds 65536" in r.json()["error"]["message"]


def test_queue_full_answers_429_then_recovers(strict):
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": OK_MSG, "max_tokens": 400, "stream": True}
    streams = []
    try:
        for _ in range(2):        # one running + one queued fill this server (max_num_seqs 1, max_queued 1)
            cm = httpx.stream("POST", strict.url + "/v1/chat/completions", json=body, headers=h, timeout=60)
            r = cm.__enter__()
            streams.append((cm, r, r.iter_lines()))
            next(streams[-1][2])
        r = httpx.post(strict.url + "/v1/chat/completions", json=chat(), headers=h, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        for cm, r, _ in streams:
            r.close()
            cm.__exit__(None, None, None)
    strict.wait_idle()
    assert "rejected" in httpx.get(strict.url + "/metrics", headers=h).text


@pytest.mark.parametrize("fields", [dict(temperature=1e-320), dict(temperature=1e-40, seed=3),
                                    dict(temperature=1.0, top_p=1e-320)])
def test_temperatures_and_top_p_too_small_for_float32_are_served(strict, fields):
    """A temperature below 1e-5 samples greedily (dividing by it would overflow float32 logits) and a
    top_p that rounds to 0 keeps the most likely token: each answers 200, and no step fails (a failed
    step would have failed every request it held; `test_healthy_after_the_matrix` counts them)."""
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(strict.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3, **fields}, headers=h,
                   timeout=60)
    assert r.status_code == 200, r.text
    greedy = httpx.post(strict.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0},
                        headers=h,
                        timeout=60)
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_healthy_after_the_matrix(strict):
    h = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(strict.url + "/health").json() == {"status": "ok"}
    r = httpx.post(strict.url + "/v1/chat/completions", json=chat(), headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    time.sleep(0.05)
    s = strict.wait_idle()
    assert s["failed_steps"] == 0
    strict.engine.store.pool.check()
