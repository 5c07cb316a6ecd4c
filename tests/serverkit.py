"""Live servers for the tests: the random tiny checkpoint with the tiny tokenizer, served by
uvicorn on a free loopback port in a background thread. `script()` makes the random model say a
given text (a test-only logits override on the engine thread), for protocol tests that need a
specific reply such as a DSML tool call."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn

from hybridkv.server.limits import ListenLimits, uvicorn_config
from hybridkv.server.serve import build_server

FIXTURES = Path(__file__).parent / "fixtures"
TOKENIZER = FIXTURES / "tokenizer-tiny" / "tokenizer.json"


class LiveServer:
    def __init__(self, limits: ListenLimits | None = None, **options):
        opts = dict(tokenizer_path=TOKENIZER, served_model_name="tiny", max_num_seqs=4, num_blocks=64,
                    max_num_batched_tokens=256)
        opts.update(options)
        self.server = build_server(FIXTURES / "v4-tiny", **opts)
        self.engine, self.driver = self.server.engine, self.server.driver
        self.scripts: dict[str, list[int]] = {}
        self.fail_marker: str | None = None
        self._wrap_forward()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(self.server.app, limits, log_level="warning", timeout_graceful_shutdown=2)
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uvicorn.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)

    def _wrap_forward(self):
        engine, tok = self.engine, self.server.tokenizer
        forward = engine._forward

        def scripted(chunks, *args):
            prompts = {c.seq.request_id: tok.decode(c.seq.prompt_ids) for c in chunks}
            if self.fail_marker and any(self.fail_marker in p for p in prompts.values()):
                raise RuntimeError("injected engine failure")
            out = forward(chunks, *args)
            for rid, logits in out.items():
                if logits.dim() != 1:      # a speculative verify chunk's rows: not scripted
                    continue
                for marker, ids in self.scripts.items():
                    n = len(engine.requests[rid].output_ids)
                    if marker in prompts.get(rid, "") and n < len(ids):
                        forced = torch.full_like(logits, -1e9)
                        forced[ids[n]] = 0.0
                        out[rid] = forced
            return out
        engine._forward = scripted

    def script(self, marker: str, text: str) -> None:
        """Requests whose prompt contains `marker` reply `text` (then EOS)."""
        self.scripts[marker] = self.server.tokenizer.encode(text) + [self.engine.config.eos_token_id]

    def stats(self) -> dict:
        key = self.server.config.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.url + "/stats", headers=headers, timeout=10).json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until no request runs and no block is held; returns the last /stats."""
        deadline = time.time() + timeout
        while True:
            s = self.stats()
            mem = s["memory"]
            if (mem["requests"]["running"] == 0 and mem["requests"]["waiting"] == 0 and mem["blocks"]["active"] == 0
                    and s["inflight"] == 0):
                return s
            if time.time() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: {s}")
            time.sleep(0.05)

    def close(self):
        self.uvicorn.should_exit = True
        self.thread.join(15)
