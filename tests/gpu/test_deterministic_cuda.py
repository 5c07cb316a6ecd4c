"""Deterministic mode: a request's logits are bit-identical whatever its batch position and size."""

from pathlib import Path

import torch

from hybridkv.model import ContiguousKV, ForwardBatch
from hybridkv.ops.backend import deterministic
from hybridkv.weights import load_model

FIXTURE = Path(__file__).parents[1] / "fixtures" / "v4-tiny"


def _run(model, cfg, prompts, target, steps=4):
    """Prefill every prompt (one batch), then decode greedily; logits of `target` at every step."""
    kvs = [ContiguousKV(cfg, torch.bfloat16, "cuda") for _ in prompts]
    batch = ForwardBatch.build([(kv, 0, len(p)) for kv, p in zip(kvs, prompts)], "cuda")
    ids = torch.cat([torch.tensor(p) for p in prompts]).cuda()
    logits = model.logits(model(ids, batch)[batch.last_rows()])
    out = [logits[target]]
    pos = [len(p) for p in prompts]
    for _ in range(steps):
        nxt = logits.argmax(-1)
        batch = ForwardBatch.build([(kv, p, 1) for kv, p in zip(kvs, pos)], "cuda")
        logits = model.logits(model(nxt, batch)[batch.last_rows()])
        out.append(logits[target])
        pos = [p + 1 for p in pos]
    return torch.stack(out)


def test_logits_do_not_depend_on_the_batch():
    model, cfg = load_model(FIXTURE, "cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, cfg.vocab_size, (300,), generator=g).tolist()
    others = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (17, 290, 140, 5, 333, 64, 200)]
    with torch.no_grad(), deterministic():
        alone = _run(model, cfg, [prompt], 0)
        first = _run(model, cfg, [prompt] + others, 0)
        middle = _run(model, cfg, others[:3] + [prompt] + others[3:], 3)
    assert torch.equal(alone, first) and torch.equal(alone, middle)
    with torch.no_grad():
        loose = _run(model, cfg, others[:3] + [prompt] + others[3:], 3)
    print(f"\nwithout deterministic mode: max |Δlogit| vs alone = {float((loose - alone).abs().max()):.3e}")
