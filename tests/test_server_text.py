"""The server releases the engine's text: /v1/completions, streamed or not, gives the same text in
the same pieces as `LLM.stream` for the same prompt and sampling, across characters that span
several tokens and around a stop string that spans two tokens."""

import json
import shutil

import httpx
import pytest

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampling import SamplingParams

PROMPT_TEXT = "日本語のテキスト 温泉 ok ü"
SAMPLING = {"max_tokens": 32, "temperature": 1.0, "top_p": 1.0, "seed": 5}


@pytest.fixture(scope="module")
def llm(fixtures, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("text") / "m"
    shutil.copytree(fixtures / "v4-tiny", model_dir, ignore=shutil.ignore_patterns("golden.safetensors"))
    shutil.copy(fixtures / "tokenizer-tiny" / "tokenizer.json", model_dir / "tokenizer.json")
    llm = LLM(model_dir, num_blocks=16, max_num_seqs=2)
    yield llm
    llm.close()


def llm_pieces(llm, prompt, stop=()):
    events = list(llm.stream([prompt], SamplingParams(**SAMPLING, stop=list(stop))))
    return [e.text for e in events if e.text], events[-1].finish_reason


def server_pieces(live_server, prompt, stop=()):
    body = {"prompt": prompt, **SAMPLING, "stop": list(stop) or None, "stream": True}
    pieces, finish = [], None
    with httpx.stream("POST", live_server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice["text"]:
                    pieces.append(choice["text"])
                finish = choice["finish_reason"] or finish
    return pieces, finish


def test_streamed_text_matches_llm_stream(live_server, llm):
    prompt = llm.tokenizer.encode(PROMPT_TEXT) * 2
    pieces, finish = llm_pieces(llm, prompt)
    full = "".join(pieces)
    assert finish == "length" and full == llm.tokenizer.decode(llm.generate([prompt], SamplingParams(**SAMPLING))[0]
                                                                 .output_ids)
    # the reply holds characters whose bytes span tokens: released whole, never as U+FFFD
    assert any(len(c.encode()) > 1 and c != "\ufffd" for c in full)
    assert server_pieces(live_server, prompt) == (pieces, finish)

    # a stop string across the boundary of two pieces: its start is held back, then cut
    i = next(i for i in range(len(pieces) // 2, len(pieces) - 1)
             if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2 and "\ufffd" not in pieces[i] + pieces[i + 1])
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    cut = full.find(stop)
    stopped, reason = llm_pieces(llm, prompt, [stop])
    assert reason == "stop" and "".join(stopped) == full[:cut]
    assert server_pieces(live_server, prompt, [stop]) == (stopped, reason)
    whole = httpx.post(live_server.url + "/v1/completions", timeout=60,
                       json={"prompt": prompt, **SAMPLING, "stop": [stop]}).json()["choices"][0]
    assert (whole["text"], whole["finish_reason"]) == (full[:cut], "stop")
    live_server.wait_idle()


def test_the_stopping_token_adds_no_text(live_server):
    live_server.script("EOSTEXT", "done here")
    r = httpx.post(live_server.url + "/v1/completions", timeout=60,
                   json={"prompt": "EOSTEXT", "max_tokens": 20, "temperature": 0}).json()["choices"][0]
    assert (r["text"], r["finish_reason"]) == ("done here", "stop")


def test_llm_text_leaves_out_the_stop_token(llm):
    prompt = llm.tokenizer.encode(PROMPT_TEXT)
    ids = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].output_ids
    k = next(k for k in range(3, len(ids)) if ids[k] not in ids[:k])
    out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[ids[k]]))[0]
    assert out.output_ids == ids[:k + 1] and out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(ids[:k])
