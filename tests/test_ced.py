"""V4.1 CED prefill (model/ced.py): the decoder layers run only over the rows a later step reads,
and the logits and every later decode step equal the full prefill's.

The fixtures' window (128) with 4 decoder layers gives a dependency cone of 4 · 127 rows, longer
than their 250-token prompts, so the tests run the fixture weights with a 16-token window (the
window is no weight; CED is compared with the full prefill of the same model)."""

import json
import shutil

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from engine_helpers import prompts_of, rel

from hybridkv.engine import LLM, SamplingParams
from hybridkv.model import ContiguousKV, ForwardBatch, ced
from hybridkv.weights import load_model

TOL = 1e-3   # the V4.1 parity bound (tests/test_parity_v41.py)
NAMES = ["v41-tiny", "v41-tiny-fp8"]
WINDOW = 16
_models = {}


def _window_copy(fixtures, tmp_path_factory, name, window=WINDOW):
    dst = tmp_path_factory.mktemp("ced") / name
    shutil.copytree(fixtures / name, dst, ignore=shutil.ignore_patterns("golden.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["sliding_window"] = window
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module", params=NAMES)
def small_window(fixtures, tmp_path_factory, request):
    if request.param not in _models:
        d = _window_copy(fixtures, tmp_path_factory, request.param)
        _models[request.param] = (d, *load_model(d))
    return _models[request.param]


def _run(model, ids, chunks, use_ced, decode=8, kv=None):
    """Logits after each chunk's last token, then `decode` one-token steps; and the CED plans."""
    kv = kv or ContiguousKV(model.config)
    pos, out, plans = 0, [], []
    with torch.inference_mode():
        for n in list(chunks) + [1] * decode:
            b = ForwardBatch.build([(kv, pos, n)])
            if use_ced:
                b.outputs = [n - 1]
            h = model(ids[pos:pos + n], b)
            out.append(model.logits(h[n - 1:n]))
            plans.append(model.last_ced)
            pos += n
    return torch.cat(out), plans


CHUNKINGS = {"one-shot": [250], "uneven": [100, 77, 73], "sevens": [7] * 35 + [5], "on-128": [128, 122],
             "short-then-long": [10, 240]}


@pytest.mark.parametrize("chunks", list(CHUNKINGS.values()), ids=list(CHUNKINGS))
def test_ced_equals_full_prefill(small_window, chunks):
    _, model, cfg = small_window
    ids = torch.tensor(prompts_of([250 + 8], seed=3)[0])
    full, _ = _run(model, ids, chunks, False)
    got, plans = _run(model, ids, chunks, True)
    assert rel(got, full) <= TOL, rel(got, full)
    skipped = sum(p.skipped_rows for p in plans if p is not None)
    # the cone of a chunk's last row reaches back 4 decoder layers x (window - 1) rows
    reach = (cfg.num_hidden_layers - ced.decoder_start(cfg)) * (WINDOW - 1)
    assert skipped == sum(max(0, n - 1 - reach) for n in chunks)


def test_a_shorter_cone_is_not_exact(small_window, monkeypatch):
    """The check above can fail: cutting the cone to 20 rows changes the logits."""
    _, model, _ = small_window
    ids = torch.tensor(prompts_of([258], seed=3)[0])
    full, _ = _run(model, ids, [250], False)
    ranges = ced._ranges
    monkeypatch.setattr(ced, "_ranges",
                        lambda c, b, o: [(max(lo, hi - 20), hi, False) for lo, hi, _ in ranges(c, b, o)])
    got, _ = _run(model, ids, [250], True)
    assert rel(got, full) > 10 * TOL


def test_several_requests_and_inner_state(small_window):
    """A ragged batch of two requests; the first one's inner segment state is read (a snapshot):
    its decoder covers that segment's cone too, and each request equals its full prefill alone."""
    _, model, cfg = small_window
    a, b = (torch.tensor(p) for p in prompts_of([200, 150], seed=4))
    kv_a, kv_b = ContiguousKV(cfg), ContiguousKV(cfg)
    batch = ForwardBatch.build([(kv_a, 0, 128, True), (kv_a, 128, 72), (kv_b, 0, 150)])
    batch.outputs = [199, 349]
    with torch.inference_mode():
        h = model(torch.cat([a, b]), batch)
        got = model.logits(h[[199, 349]])
    plan = model.last_ced
    assert plan is not None and plan.skipped_rows > 0 and torch.isnan(h[0]).all()
    reach = (cfg.num_hidden_layers - ced.decoder_start(cfg)) * (WINDOW - 1)
    assert plan.skipped_rows == (127 - reach) + (199 - 128 - reach) + (149 - reach)
    for ids, want_row, kv in ((a, 0, kv_a), (b, 1, kv_b)):
        full, _ = _run(model, ids, [ids.numel()], False, decode=0)
        assert rel(got[want_row:want_row + 1], full) <= TOL
    # decode continues from the CED state as from the full one
    more = torch.tensor(prompts_of([4], seed=5)[0])
    with torch.inference_mode():
        ref_kv = ContiguousKV(cfg)
        model(a, ForwardBatch.build([(ref_kv, 0, 200)]))
        for i, t in enumerate(more):
            x = model.logits(model(t.view(1), ForwardBatch.build([(kv_a, 200 + i, 1)])))
            y = model.logits(model(t.view(1), ForwardBatch.build([(ref_kv, 200 + i, 1)])))
            assert rel(x, y) <= TOL


def test_native_window_cone_covers_short_prompts(fixtures):
    """With the fixtures' own 128-token window the cone (508 rows) covers a 250-token prompt: nothing
    is skipped, and no plan is made."""
    model, cfg = load_model(fixtures / "v41-tiny")
    ids = torch.tensor(prompts_of([250], seed=3)[0])
    _, plans = _run(model, ids, [250], True, decode=0)
    assert plans == [None]


def test_skipped_flops_accounting(small_window):
    """The accounting counts the weight matmuls of the skipped rows: it is the measured difference
    of the two forwards' matmul FLOPs less what attention and indexer scoring spend (not counted),
    so it lies below the measured saving and covers most of it at this short context."""
    _, model, cfg = small_window
    if model.layers[0].attn.wq_a.fmt != "float":
        pytest.skip("FlopCounterMode sees the float GEMMs only")
    ids = torch.tensor(prompts_of([250], seed=3)[0])
    flops = []
    for use_ced in (False, True):
        b = ForwardBatch.build([(ContiguousKV(cfg), 0, 250)])
        b.outputs = [249] if use_ced else None
        with torch.inference_mode(), FlopCounterMode(display=False) as fc:
            model(ids, b)
        flops.append(fc.get_total_flops())
    measured = flops[0] - flops[1]
    accounted = ced.skipped_flops(model, model.last_ced)
    per_row = sum(ced.token_weight_flops(model.layers[i], i != model.last_ced.source)
                  for i in range(ced.decoder_start(cfg), cfg.num_hidden_layers))
    assert accounted == model.last_ced.skipped_rows * per_row > 0
    assert 0.5 * measured < accounted <= measured, (accounted, measured)


# ----- through the engine: chunked prefill, prefix hits, each window policy -----

@pytest.fixture(scope="module")
def small_windows(fixtures, tmp_path_factory):
    return {name: _window_copy(fixtures, tmp_path_factory, name) for name in NAMES}


@pytest.mark.parametrize("name,policy", [
    ("v41-tiny", "full"), ("v41-tiny", "checkpoint(256)"), ("v41-tiny", "zero"), ("v41-tiny-fp8", "zero"),
    pytest.param("v41-tiny-fp8", "full", marks=pytest.mark.slow),
    pytest.param("v41-tiny-fp8", "checkpoint(256)", marks=pytest.mark.slow)])
def test_engine_ced_equals_full(small_windows, name, policy):
    d = small_windows[name]
    shared = prompts_of([300], seed=7)[0]
    prompts = [shared + p for p in prompts_of([150, 90], seed=8)]   # the second and third hit the prefix
    prompts = [prompts[0], prompts[1], prompts[0][:280] + prompts_of([60], seed=9)[0]]
    runs = {}
    for on in (False, True):
        llm = LLM(d, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=100, window_policy=policy,
                  ced_prefill=on)
        llm.engine.record_logits = True
        llm.engine.finished = {}
        outs = []
        for p in prompts:   # one after the other: later ones hit the earlier ones' prefix
            outs += llm.generate([p], SamplingParams(max_tokens=6, ignore_eos=True))
        seqs = [llm.engine.finished[o.request_id] for o in outs]
        runs[on] = (seqs, llm.engine.stats)
        assert sum(s.num_cached_tokens for s in seqs) > 0, "no prefix hit"
    (full, st_full), (got, st) = runs[False], runs[True]
    assert st_full.ced_skipped_rows == 0
    # `full` reads the state at every block boundary: only the rows before each boundary's cone go
    assert st.ced_skipped_rows > 0 and st.ced_skipped_flops > 0
    for a, b in zip(got, full):
        assert a.output_ids == b.output_ids and a.num_cached_tokens == b.num_cached_tokens
        for x, y in zip(a.step_logits, b.step_logits):
            assert rel(x, y) <= TOL
