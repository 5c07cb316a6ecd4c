"""The engine's paged attention path (what runs on CUDA through the Triton kernels) against the
reference path that gathers and decodes rows first. On the CPU the paged ops run their plain-torch
definitions, so these tests check the wiring: which rows each token reads, the ring written after
the segment's attention, entries appended before it. tests/gpu compares the kernels themselves."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridkv.cache.paged import KernelArgs, PagedDecodeKV, PagedKVStore, PagedSeqKV, SeqCache
from hybridkv.engine import LLM, SamplingParams
from hybridkv.eval.runner import build_samples, score
from hybridkv.presets import load_config
from hybridkv.tasks.tokenizer import TaskTokenizer

ROOT = Path(__file__).parents[1]
MODEL = ROOT / "models" / "tiny-v4"
FP8_FIXTURE = ROOT / "tests" / "fixtures" / "v4-tiny-fp8"


def _generate(model, prompts, paged: bool, max_tokens: int, **kw):
    llm = LLM(model, num_blocks=96, max_num_seqs=len(prompts), max_num_batched_tokens=1024, **kw)
    assert llm.engine.store.kernel_formats is None          # CPU: the reference path unless asked
    if paged:
        # the formats the paged ops read this store in (CUDA decides this itself; see PagedKVStore)
        llm.engine.store.kernel_formats = {"fp8": ("fp8", "fp4"), "v41": ("v41", "fp4")}.get(kw.get("kv_format"),
                                                                                            ("bf16", "bf16"))
    llm.engine.record_logits = True
    llm.engine.finished = {}
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    logits = {s.request_id: torch.stack(s.step_logits).float() for s in llm.engine.finished.values()}
    return outs, logits


def test_paged_path_retrieves_what_the_reference_path_retrieves():
    """The trained model answers 1.5K passkey prompts (CSA top-64 of ~375 visible entries, HCA 11)
    identically through both paths, batched (two prefills, then a decode group of two); the logits
    agree to what top-k near-ties and quantisation steps allow."""
    tok = TaskTokenizer.load(MODEL)
    samples = [s for _, s in build_samples(tok, ["passkey"], [1536], 2, seed=3)]
    prompts = [s.prompt for s in samples]
    ref, ref_logits = _generate(MODEL, prompts, False, 8)
    paged, paged_logits = _generate(MODEL, prompts, True, 8)
    for s, a, b in zip(samples, ref, paged):
        assert a.output_ids == b.output_ids
        assert score(s, b.text) == 1.0
    for rid, a in ref_logits.items():
        rel = float((a - paged_logits[rid]).norm() / a.norm())
        assert rel < 2e-2, (rid, rel)


def test_paged_path_reads_packed_fp8_entries_and_fp4_keys():
    """The deployed formats (584-B main entries, 68-B FP4 indexer keys) through the paged path: the
    prefill logits of a random-weight checkpoint agree with the reference path's."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (700, 420)]
    ref, ref_logits = _generate(FP8_FIXTURE, prompts, False, 2, kv_format="fp8", dtype=torch.bfloat16)
    paged, paged_logits = _generate(FP8_FIXTURE, prompts, True, 2, kv_format="fp8", dtype=torch.bfloat16)
    worst = max(float((a[0] - paged_logits[rid][0]).norm() / a[0].norm()) for rid, a in ref_logits.items())
    assert worst < 0.1


V41_FIXTURE = ROOT / "tests" / "fixtures" / "v41-tiny"


def test_v41_decode_reads_the_packed_layout_as_the_reference_path_does():
    """V4.1 decode attention on the paged path (the window from each layer's ring, the selected global
    entries from the kv source's pool, both in the packed "v41" layout) against the reference path:
    a ragged decode group past the window (the ring wrapped) over Full, Reindex (candidate pool) and
    Reuse layers of ratios 2 and 1."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (300, 170)]
    kw = dict(kv_format="v41")
    ref, ref_logits = _generate(V41_FIXTURE, prompts, False, 6, **kw)
    paged, paged_logits = _generate(V41_FIXTURE, prompts, True, 6, **kw)
    for rid, a in ref_logits.items():
        b = paged_logits[rid]
        assert torch.equal(a[0], b[0])                  # prefill: the reference path on both
        rel = float((a[1:] - b[1:]).norm() / a[1:].norm())
        assert rel < 1e-4, (rid, rel)


def test_the_paged_path_is_not_taken_where_its_rows_would_be_wrong():
    """A window that starts after position 0 (bounded replay, state-less prefix hit) takes the
    reference path; in offload mode the paged path reads CSA main entries from the device pages."""
    cfg = load_config(FP8_FIXTURE)
    store = PagedKVStore(cfg, 16, 2, "fp8", torch.bfloat16)
    store.kernel_formats = ("fp8", "fp4")
    seq = SeqCache(0, [3, 4, 5, 6], window_start=256)
    view = PagedSeqKV(store, seq)
    assert view.kernel_args(256, 64) is None             # its ring holds nothing before 256
    assert view.kernel_args(383, 1) is not None           # 383's window starts at 256
    args = view.kernel_args(400, 32)
    assert isinstance(args, KernelArgs) and args.max_pos == 431 and args.batch.block_tables.tolist() == [[3, 4, 5, 6]]
    dkv = PagedDecodeKV(store, [seq, SeqCache(1, [7, 8], window_start=0)], torch.tensor([300, 200]))
    assert dkv.kernel_args() is None                     # the first request's window still reaches 173 < 256
    dkv = PagedDecodeKV(store, [seq, SeqCache(1, [7, 8], window_start=0)], torch.tensor([383, 200]))
    assert dkv.kernel_args().max_pos == 383
    offload = PagedKVStore(cfg, 16, 2, "fp8", torch.bfloat16, resident_pages=8)
    offload.kernel_formats = ("fp8", "fp4")
    seq = SeqCache(0, [3, 4, 5], pages=[6, -1, 2])
    args = PagedSeqKV(offload, seq).kernel_args(300, 20)
    csa, n_csa = 1, len(offload.pages)                    # layer 1: the first CSA layer
    assert args.pool(csa, "kv") is offload.page_rows and args.pool(csa, "index") is offload.entries[csa]["index"]
    assert args.tables(csa, "kv").tolist() == [[6 * n_csa, -1, 2 * n_csa]]
    assert args.tables(csa, "index").tolist() == [[3, 4, 5]] and args.resident(csa).tolist() == [[6, -1, 2]]
    hca = next(i for i in range(cfg.num_hidden_layers) if cfg.layer_ratio(i) == 128)
    assert args.pool(hca, "kv") is offload.entries[hca]["kv"] and args.resident(hca) is None


def _offload_run(model, prompts, paged: bool, policy: str, **kw):
    """`_generate` under an offloading memory policy, one request after the other (the second hits the
    first one's cached blocks, whose CSA pages it loads from host memory); prefix caching on."""
    llm = LLM(model, num_blocks=96, max_num_seqs=1, max_num_batched_tokens=512, memory_policy=policy, **kw)
    if paged:
        llm.engine.store.kernel_formats = {"fp8": ("fp8", "fp4"), "v41": ("v41", "fp4")}.get(kw.get("kv_format"),
                                                                                            ("bf16", "bf16"))
    llm.engine.record_logits = True
    outs, logits = [], {}
    for p in prompts:
        llm.engine.finished = {}
        outs += llm.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))
        logits.update({s.request_id: torch.stack(s.step_logits).float() for s in llm.engine.finished.values()})
    return outs, logits, llm.engine.stats


@pytest.mark.parametrize("model,kw", [(MODEL, {}), (FP8_FIXTURE, dict(kv_format="fp8", dtype=torch.bfloat16))],
                         ids=["tiny-v4", "fp8-packed"])
def test_offloading_policy_on_the_paged_path_equals_the_reference_path(model, kw):
    """recency-256 keeps 2 or 3 of a 1,100-token prompt's 9 blocks resident: through the paged path
    the CSA layers select among the resident blocks only and read their device pages, new entries
    go into the pages, and each block's page is written back to host memory when the block completes.
    The second request repeats the first's prompt and hits its blocks, whose pages come back from
    those host copies. Outputs and logits equal the reference path's (which writes the host copy at
    once)."""
    g = torch.Generator().manual_seed(3)
    first = torch.randint(10, 500, (1100,), generator=g).tolist()
    prompts = [first, first + [7, 8, 9]]
    ref, ref_logits, ref_stats = _offload_run(model, prompts, False, "recency-256", **kw)
    paged, paged_logits, stats = _offload_run(model, prompts, True, "recency-256", **kw)
    assert ref_stats.pages_evicted > 0 and stats.pages_evicted == ref_stats.pages_evicted
    assert stats.cached_prompt_tokens == ref_stats.cached_prompt_tokens >= 1024
    assert stats.pages_written_back >= 8 and ref_stats.pages_written_back == 0
    for a, b in zip(ref, paged):
        assert a.output_ids == b.output_ids
    for rid, a in ref_logits.items():
        rel = float((a - paged_logits[rid]).norm() / a.norm())
        assert rel < 2e-2, (rid, rel)


@pytest.mark.parametrize("mode", ["reference", "bogus"])
def test_kernel_mode_variable(monkeypatch, mode):
    from hybridkv.ops.backend import use_triton
    monkeypatch.setenv("HYBRIDKV_KERNELS", mode)
    if mode == "bogus":
        with pytest.raises(ValueError, match="auto, reference or triton"):
            use_triton(torch.zeros(1))
    else:
        assert not use_triton(torch.zeros(1))


@pytest.mark.parametrize("start,length,frozen", [(0, 300, 0), (256, 200, 256), (100, 300, 256)])
def test_fused_compressor_write_stores_the_bytes_of_the_unfused_path(start, length, frozen):
    """Pooling, norm, RoPE, quantisation and packing straight into the pool (what the paged path does
    for packed stores) leaves every byte the compressor's entries + the store's encoder would, over
    two chunks; the entries of a prefix hit (below `frozen`) keep their bytes."""
    from hybridkv.ops.rope import rope_freqs
    from hybridkv.weights import load_model
    model, cfg = load_model(FP8_FIXTURE, dtype=torch.bfloat16)
    attn = model.layers[1].attn
    assert attn.ratio == 4 and attn.indexer is not None
    g = torch.Generator().manual_seed(start + length)
    x = torch.randn(start + length, cfg.hidden_size, generator=g).bfloat16()
    positions = torch.arange(start + length)
    with torch.no_grad():
        rows = attn._token_rows(x, attn.q_norm(attn.wq_a(x)), rope_freqs(positions, attn.inv_freq),
                                SimpleNamespace(positions=positions))
    pools = []
    for fused in (False, True):
        store = PagedKVStore(cfg, 8, 1, "fp8", torch.bfloat16)
        store.kernel_formats = ("fp8", "fp4")
        for kind in ("kv", "index"):
            store.entries[1][kind].fill_(0x11)          # stands for bytes a prefix hit provides
        view = PagedSeqKV(store, SeqCache(0, [5, 2, 7, 0], frozen_until=frozen))
        with torch.no_grad():
            for a, b in ((0, start), (start, start + length)):
                if b > a:
                    chunk = {k: v[a:b] for k, v in rows.items()}
                    attn._append_compressed_v4(a, view.layer(1), chunk, view.kernel_args(a, b - a) if fused else None)
        pools.append({k: store.entries[1][k].clone() for k in ("kv", "index")})
    for kind in ("kv", "index"):
        assert torch.equal(pools[0][kind], pools[1][kind]), kind
        first_block = pools[1][kind][5]                   # block 0 of the request: entries 0..31
        assert bool((first_block == 0x11).all()) == (frozen >= 128)


def test_memory_policy_page_traffic_in_the_snapshot_and_metrics():
    """/metrics counts the pages an offloading policy moved and their bytes, from the engine's stats."""
    from hybridkv.server.memory import memory_snapshot
    from hybridkv.server.metrics import Metrics

    llm = LLM(FP8_FIXTURE, num_blocks=32, max_num_seqs=1, max_num_batched_tokens=512, memory_policy="recency-256",
              kv_format="fp8", dtype=torch.bfloat16)
    eng = llm.engine
    eng.store.kernel_formats = ("fp8", "fp4")
    g = torch.Generator().manual_seed(5)
    llm.generate([torch.randint(10, 500, (700,), generator=g).tolist()], SamplingParams(max_tokens=4))
    mp = memory_snapshot(eng)["memory_policy"]
    st = eng.stats
    assert mp == {"name": "recency-256", "offloads": True, "page_bytes": eng.store.page_bytes(),
                  "pages_loaded": st.pages_loaded, "pages_evicted": st.pages_evicted,
                  "pages_written_back": st.pages_written_back}
    assert st.pages_evicted > 0 and st.pages_written_back >= 5 and mp["page_bytes"] > 0
    m = Metrics("tiny")
    m.snapshot_source = lambda: memory_snapshot(eng)
    series = {}
    for line in m.render().decode().splitlines():
        if line.startswith("hybridkv:memory_policy"):
            head, value = line.rsplit(" ", 1)
            metric, labels = head.rstrip("}").split("{")
            series[metric, frozenset(labels.split(","))] = float(value)
    base = {'model_name="tiny"', 'policy="recency-256"'}
    for event in ("loaded", "evicted", "written_back"):
        assert series["hybridkv:memory_policy_pages_total", frozenset(base | {f'event="{event}"'})] == \
            getattr(st, "pages_" + event)
    assert series["hybridkv:memory_policy_transfer_bytes_total", frozenset(base | {'direction="to_host"'})] == \
        st.pages_written_back * mp["page_bytes"]


def test_compressor_states_of_one_shape_are_one_tensor():
    """Every layer's compressor state of one shape is a view of its group's tensor (what the
    speculative rollback restores a group at a time); each layer lists its kinds in the order its
    snapshots store them; a new slot starts zeroed with −inf scores in every member."""
    from hybridkv.model.state import layer_storage
    cfg = load_config(FP8_FIXTURE)
    store = PagedKVStore(cfg, 16, 3, "fp8", torch.bfloat16)
    members = [m for g in store.state_groups for m in g.members]
    assert sorted(members) == sorted((i, k) for i in range(cfg.num_hidden_layers) for k in store.states[i])
    assert len(store.state_groups) < len(members)                # layers of one ratio share a tensor
    for g in store.state_groups:
        for m, (i, kind) in enumerate(g.members):
            kv, score = store.states[i][kind]
            assert kv.data_ptr() == g.kv[m].data_ptr() and score.data_ptr() == g.score[m].data_ptr()
            assert kv.is_contiguous() and score.is_contiguous()
    for i in range(cfg.num_hidden_layers):
        assert list(store.states[i]) == list(layer_storage(cfg, i)[1])
    for g in store.state_groups:
        g.kv.fill_(3.0)
        g.score.fill_(3.0)
    seq = store.new_seq()
    for g in store.state_groups:
        assert bool((g.kv[:, seq.slot] == 0).all()) and bool((g.score[:, seq.slot] == float("-inf")).all())
        others = [s for s in range(3) if s != seq.slot]
        assert bool((g.kv[:, others] == 3.0).all())
