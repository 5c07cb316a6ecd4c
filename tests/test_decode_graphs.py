"""The fixed-shape decode step that the engine captures into CUDA graphs (engine/graphs.py), checked on
the CPU where the same forward runs eagerly: its pieces (masked compressor completion, the MoE's
routed experts without token lists, the context buckets) against the code paths they replace, and
whole decodes through the engine against its own batched decode. tests/gpu captures and replays."""

from pathlib import Path

import pytest
import torch

from hybridkv.engine import LLM, SamplingParams
from hybridkv.engine.graphs import DecodeGraphs, context_bucket

ROOT = Path(__file__).parents[1]
FP8_FIXTURE = ROOT / "tests" / "fixtures" / "v4-tiny-fp8"


@pytest.fixture(scope="module")
def fp8_llm():
    return LLM(FP8_FIXTURE, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=2048, kv_format="fp8")


def test_context_buckets_cover_the_position_in_block_multiples_with_little_slack():
    for max_pos in [0, 5, 255, 256, 1000, 4095, 4096, 70_000, 131_071, 1_048_000]:
        cap = context_bucket(max_pos, 128)
        assert cap >= max_pos + 1 and cap % 128 == 0
        assert cap <= max(256, (max_pos + 1) * 1.25 + 128), (max_pos, cap)
    # one bucket serves a run of positions: a long decode recaptures rarely
    assert len({context_bucket(p, 128) for p in range(100_000, 110_000)}) <= 2


def test_masked_compressor_completion_writes_and_advances_like_the_selecting_one(fp8_llm):
    """Compressor.update_decode with a writer (every request's rows, entry id −1 where no block
    completes) against the path that selects the completing requests: the same states after the
    step, the same entries at the same ids, nothing stored for the others."""
    model = fp8_llm.engine.model
    g = torch.Generator().manual_seed(1)
    for layer in (1, 2):                                    # ratio 4 (overlapping) and ratio 128
        attn = model.layers[layer].attn
        comp = attn.compressor
        r, width = comp.ratio, comp.wkv.out_features
        rows = 2 * r if comp.overlap else r
        positions = torch.tensor([3, 6, 4 * r - 1, 129, 255]) if r == 4 else torch.tensor([127, 200, 255, 1000, 1023])
        b = positions.shape[0]
        st_kv = torch.randn(b, rows, width, generator=g)
        st_score = torch.randn(b, rows, width, generator=g)
        kv, score = torch.randn(b, width, generator=g), torch.randn(b, width, generator=g)
        ref_kv, ref_score = st_kv.clone(), st_score.clone()
        which, entries = comp.update_decode(ref_kv, ref_score, kv, score, positions, attn.inv_freq)
        written = {}

        def write(block_rows, block_starts, requests, entry_ids):
            done = entry_ids >= 0
            finished = comp.finish(tuple(t[done] for t in block_rows), block_starts[done], attn.inv_freq)
            for req, j, e in zip(requests[done].tolist(), entry_ids[done].tolist(), finished):
                written[req] = (j, e)

        comp.update_decode(st_kv, st_score, kv, score, positions, attn.inv_freq, write)
        assert torch.equal(st_kv, ref_kv) and torch.equal(st_score, ref_score)
        assert sorted(written) == which.tolist() and len(which) >= 2
        for i, req in enumerate(which.tolist()):
            j, e = written[req]
            assert j == int(positions[req]) // r
            assert torch.equal(e, entries[i])


@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_routed_experts_without_token_lists_match_the_per_expert_loop(fp8_llm, tokens):
    """MoE._routed_static (gathered experts for one token, every expert for more) against the loop
    over experts with their token lists; a hash-routed layer and a gated one."""
    model = fp8_llm.engine.model
    g = torch.Generator().manual_seed(tokens)
    for layer in (0, 2):
        moe = model.layers[layer].ffn
        x = torch.randn(tokens, model.config.hidden_size, generator=g) * 0.5
        ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=g)
        eager, static = moe(x, ids).float(), moe(x, ids, static=True).float()
        assert (eager - static).norm() / eager.norm() < 1e-5, layer


def _decode(llm, prompts, graphs: bool, steps: int):
    eng = llm.engine
    # the paged path's formats (CUDA decides this itself)
    eng.store.kernel_formats = ("fp8", "fp4") if eng.store.fmt == "fp8" else ("bf16", "bf16")
    eng.graphs = DecodeGraphs(eng.model, eng.store, capture=False) if graphs else None
    eng.record_logits = True
    eng.finished = {}
    before = eng.stats.graph_steps
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))
    finally:
        eng.store.kernel_formats, eng.graphs = None, None
    seqs = [eng.finished[o.request_id] for o in outs]
    return outs, [torch.stack(s.step_logits).float() for s in seqs], eng.stats.graph_steps - before, seqs


@pytest.mark.parametrize("kv_format", ["fp8", "native"])
def test_engine_decode_through_the_fixed_shape_forward_matches_its_batched_decode(kv_format):
    """Three requests decoding together (a batch padded to four; the 1148-token one completes an HCA
    block at 1151 and moves to a new block at 1152, inside one context bucket, so the graph's block
    tables are refreshed in place; CSA blocks complete every 4 positions) through the fixed-shape
    forward and through the
    engine's batched decode: the same tokens, logits within the MoE's summation order, the same
    compressed entries, the step counted as a graph step, and the window-state snapshot published at
    1152 (taken after the step instead of layer by layer) holding the same state and serving."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (1148, 700, 300)]
    runs = []
    for graphs in (False, True):
        llm = LLM(FP8_FIXTURE, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=2048, kv_format=kv_format)
        runs.append((llm.engine, *_decode(llm, prompts, graphs, 12)))
    (ref_eng, ref, ref_logits, n_ref, ref_seqs), (eng, out, logits, n_graph, seqs) = runs
    assert n_ref == 0 and n_graph == 11                    # every step after the prefill's first token
    for a, b, la, lb in zip(ref, out, ref_logits, logits):
        assert a.output_ids == b.output_ids
        assert (la - lb).norm() / la.norm() < 1e-4
    assert context_bucket(1147, 128) == context_bucket(1155, 128)
    key = seqs[0].block_hashes[1152 // 128 - 1]
    assert key == ref_seqs[0].block_hashes[1152 // 128 - 1]
    snap, ref_snap = eng.prefix.snapshots.get(key), ref_eng.prefix.snapshots.get(key)
    assert snap is not None and ref_snap is not None
    for layer, ref_layer in zip(snap, ref_snap):          # per layer: window ring, compressor states
        for a, b in zip(layer, ref_layer):
            assert a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-3, rtol=1e-3)
    # the compressed entries decode wrote (block 9 was appended mid-decode: its CSA entries must land there)
    for layer, (ents, ref_ents) in enumerate(zip(eng.store.entries, ref_eng.store.entries)):
        for kind, pool in ents.items():
            codec = eng.store.codec[kind]
            a, b = codec.decode(codec.block_rows(pool)), codec.decode(codec.block_rows(ref_ents[kind]))
            assert torch.allclose(a, b, atol=2e-2, rtol=2e-2), (layer, kind)
    # and it serves: a request continuing those tokens starts at 1152 from the cache
    follow = eng.add_request(seqs[0].token_ids[:1154], SamplingParams(max_tokens=1, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert follow.num_cached_tokens == 1152


def test_graph_inputs_refresh_only_the_rows_whose_tables_changed(monkeypatch):
    """Requests at their own positions open blocks at different steps, and a request that ends leaves
    its row to the padding: the graph's inputs are then rewritten row by row, and after every step
    equal the inputs built from scratch (ids, positions, slots, block tables, zeros for padding)."""
    from hybridkv.engine import graphs as graphs_mod
    checked, partial = [], []
    run, changed_rows = DecodeGraphs.run, graphs_mod._changed_rows

    def spy_changed(old, new):
        rows = changed_rows(old, new)
        partial.append(0 < 2 * len(rows) <= max(len(old), len(new), 1) and len(rows))
        return rows

    def checked_run(self, ids, seqs, positions):
        out = run(self, ids, seqs, positions)
        g = self.last
        heads = torch.tensor([[t, p, s.slot] for t, p, s in zip(ids, positions, seqs)]
                             + [[0, 0, self.pad_slot]] * (g.inputs.shape[0] - len(seqs)), dtype=torch.long)
        checked.append(torch.equal(g.inputs, self._host_inputs(heads, seqs, (g.inputs.shape[1] - 3) * 128)))
        return out
    monkeypatch.setattr(DecodeGraphs, "run", checked_run)
    monkeypatch.setattr(graphs_mod, "_changed_rows", spy_changed)
    g = torch.Generator().manual_seed(3)
    llm = LLM(FP8_FIXTURE, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=2048, kv_format="fp8")
    eng = llm.engine
    eng.store.kernel_formats = ("fp8", "fp4")
    eng.graphs = DecodeGraphs(eng.model, eng.store, capture=False)
    try:
        # one context bucket throughout (positions < 768); blocks open at 384, 256 and 512 (decode steps
        # 4, 6 and 7), and the second request ends after 20 tokens
        for n, steps in ((650, 40), (250, 20), (380, 30), (505, 35)):
            eng.add_request(torch.randint(10, 500, (n,), generator=g).tolist(),
                            SamplingParams(max_tokens=steps, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
    finally:
        eng.store.kernel_formats, eng.graphs = None, None
    assert len(checked) > 30 and all(checked)
    assert sum(1 for p in partial if p) >= 3          # steps that rewrote a few rows, not the whole buffer


V41_FIXTURE = ROOT / "tests" / "fixtures" / "v41-tiny"


def test_v41_decode_through_the_fixed_shape_forward_matches_its_batched_decode():
    """V4.1 in its packed layout: three requests (ratios 2 and 1; Full, Reindex and Reuse layers),
    one completing a ratio-2 entry every other step, through the fixed-shape forward (the Full
    layers' entries appended with fixed shapes) and through the engine's batched decode: the same
    tokens, logits within the MoE's summation order, the same stored entries."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (300, 263, 150)]
    runs = []
    for graphs in (False, True):
        llm = LLM(V41_FIXTURE, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=2048, kv_format="v41")
        eng = llm.engine
        eng.store.kernel_formats = ("v41", "fp4")          # the paged path, as on CUDA
        eng.graphs = DecodeGraphs(eng.model, eng.store, capture=False) if graphs else None
        eng.record_logits, eng.finished = True, {}
        before = eng.stats.graph_steps
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        logits = [torch.stack(eng.finished[o.request_id].step_logits).float() for o in outs]
        runs.append((eng, outs, logits, eng.stats.graph_steps - before))
    (ref_eng, ref, ref_logits, n_ref), (eng, out, logits, n_graph) = runs
    assert n_ref == 0 and n_graph == 7
    for a, b, la, lb in zip(ref, out, ref_logits, logits):
        assert a.output_ids == b.output_ids
        assert (la - lb).norm() / la.norm() < 1e-4
    for layer, (ents, ref_ents) in enumerate(zip(eng.store.entries, ref_eng.store.entries)):
        for kind, pool in ents.items():
            codec = eng.store.codec[kind]
            a, b = codec.decode(codec.block_rows(pool)), codec.decode(codec.block_rows(ref_ents[kind]))
            assert torch.allclose(a, b, atol=2e-2, rtol=2e-2), (layer, kind)


def test_fixed_shape_forward_is_refused_where_the_paged_path_does_not_run(fp8_llm):
    eng = fp8_llm.engine
    eng.store.kernel_formats = None
    assert not DecodeGraphs.supported(eng.model, eng.store, "native")
    eng.store.kernel_formats = ("fp8", "fp4")
    assert DecodeGraphs.supported(eng.model, eng.store, "native")
    assert not DecodeGraphs.supported(eng.model, eng.store, "random")
    graphs = DecodeGraphs(eng.model, eng.store, capture=False)
    seq = eng.store.new_seq()
    try:
        seq.window_start = 512                              # a bounded replay: the ring is incomplete
        assert not graphs.eligible([seq], [600])
        assert graphs.eligible([seq], [700])
    finally:
        eng.store.free_seq(seq)
        eng.store.kernel_formats = None


@pytest.mark.parametrize("policy", ["recency-256", "flashmemory-0.5"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_offloading_policies_decode_through_the_fixed_shape_forward(fixtures, warm_start_indexer, policy,
                                                                    async_scheduling, monkeypatch):
    """Under a memory policy that keeps only some blocks' CSA main entries on the device, the
    fixed-shape step reads and writes them through each request's device pages (the graph's inputs
    refreshed when a recall changes them). Three requests over 70 decode steps, across the recall at
    64 and block ends, against the engine's batched decode: the same pages recalled and written back,
    every decode step a graph step. Without async scheduling the same tokens and logits (within the
    MoE's summation order and the near-ties it flips). With it every step but the first is queued
    ahead, the recall too: it reads its own step's layer inputs (scored before the next step is
    queued), and its resident set takes over one step later (the step queued behind it was launched with the old pages), so the
    tokens agree up to the recall."""
    from engine_helpers import prompts_of
    from hybridkv.memory.indexer import MemoryIndexer

    scored = []          # the memory indexer's inputs at every recall, run by run, request by request
    probabilities, paged = MemoryIndexer.probabilities, MemoryIndexer.paged_probabilities

    def record(self, xs, positions, keys):
        scored[-1].append((positions.tolist(), {layer: x.clone() for layer, x in xs.items()}))
        return probabilities(self, xs, positions, keys)

    def record_paged(self, xs, positions, *args):        # the recalls due in one step, scored at once
        for i, p in enumerate(positions.tolist()):
            scored[-1].append(([p], {layer: x[i:i + 1].clone() for layer, x in xs.items()}))
        return paged(self, xs, positions, *args)
    monkeypatch.setattr(MemoryIndexer, "probabilities", record)
    monkeypatch.setattr(MemoryIndexer, "paged_probabilities", record_paged)
    prompts = prompts_of([740, 700, 300], seed=12)
    kw = {"memory_indexer": str(warm_start_indexer)} if policy.startswith("flashmemory") else {}
    runs = []
    for graphs in (False, True):
        scored.append([])
        llm = LLM(fixtures / "v4-tiny", num_blocks=48, max_num_seqs=4, max_num_batched_tokens=2048,
                  memory_policy=policy, async_scheduling=async_scheduling and graphs, **kw)
        runs.append((llm.engine.stats, *_decode(llm, prompts, graphs, 70)))
    (ref_stats, ref, ref_logits, n_ref, _), (stats, out, logits, n_graph, _) = runs
    assert n_ref == 0 and n_graph == 69 and stats.queued_steps == (68 if async_scheduling else 0)
    agree = 65 if async_scheduling else 70          # the tokens up to the one that runs the recall
    for a, b, la, lb in zip(ref, out, ref_logits, logits):
        assert a.output_ids[:agree] == b.output_ids[:agree]
        # per step: the MoE's summation order (~1e-4), and over 70 steps a top-k near-tie or two that
        # the order flips (a step at ~2e-2, seen once)
        rel = torch.stack([(x - y).norm() / x.norm() for x, y in zip(la[:agree], lb[:agree])])
        assert rel.median() < 3e-4 and rel.max() < 5e-2
    assert stats.pages_loaded == ref_stats.pages_loaded and stats.pages_evicted == ref_stats.pages_evicted > 0
    assert stats.pages_written_back == ref_stats.pages_written_back > 0
    assert len(scored[0]) == len(scored[1]) == (6 if policy.startswith("flashmemory") else 0)   # 3 requests x 2
    for (pos_a, xs_a), (pos_b, xs_b) in zip(scored[0], scored[1]):
        assert pos_a == pos_b and all(torch.allclose(xs_a[k], xs_b[k], atol=1e-4) for k in xs_a)
