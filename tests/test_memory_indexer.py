"""FlashMemory's memory indexer: warm start from the native indexer, its file, the serving policy's
resident blocks, and `hybridkv train-memory-indexer` end to end on the shipped model."""

import json
from pathlib import Path

import pytest
import torch

from hybridkv.errors import ConfigError
from hybridkv.memory.indexer import MemoryIndexer
from hybridkv.memory.policies import FlashMemory, parse_policy
from hybridkv.train.memory_labels import load_labels

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "tiny-v4"


@pytest.fixture(scope="module")
def model():
    from hybridkv.train.export import float_model
    return float_model(SHIPPED)


def test_the_warm_start_scores_like_the_native_indexer(model):
    """Twice the heads and rank, the new ones silent: the logits are the native indexer's up to its
    FP4 query round trip (which the memory indexer does not make)."""
    from hybridkv.ops.indexer_topk.reference import index_scores
    from hybridkv.train.forward import TrainOptions, train_forward

    mi = MemoryIndexer.from_native(model)
    assert mi.config.layers == [1, 3, 5] and mi.config.heads == 8 and mi.config.rank == 256
    ids = torch.randint(2, 4096, (1, 600), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cap = train_forward(model, ids, TrainOptions(dense_indexer=False, qat_indexer=True, kl_queries=1,
                                                     capture_indexer=True)).aux.captured
        t = torch.arange(400, 600)
        for layer in mi.config.layers:
            c = cap[layer]
            native = index_scores(c["q"][t], c["w"][t], c["keys"][0])
            ours = mi.layer_logits(layer, c["x"][t], t, c["keys"][0])
            assert float((ours - native).norm() / native.norm()) < 0.1, layer
            assert float(torch.corrcoef(torch.stack([ours.flatten(), native.flatten()]))[0, 1]) > 0.99, layer
    with pytest.raises(ConfigError, match="not CSA layers"):
        MemoryIndexer.from_native(model, layers=[0, 1])


def test_the_weights_file_round_trips_and_a_wrong_file_is_refused(model, tmp_path):
    from safetensors.torch import save_file

    mi = MemoryIndexer.from_native(model, layers=[3], heads=6, rank=160)
    path = mi.save(tmp_path)
    assert path.name == "memory_indexer.safetensors"
    again = MemoryIndexer.load(tmp_path)
    x, keys = torch.randn(5, 256), torch.randn(40, 64)
    assert torch.equal(again.layer_logits(3, x, torch.arange(5), keys), mi.layer_logits(3, x, torch.arange(5), keys))
    assert again.config == mi.config
    save_file({"inv_freq": torch.zeros(2)}, str(tmp_path / "x.safetensors"), metadata={"format": "other"})
    with pytest.raises(ConfigError, match="not a memory indexer"):
        MemoryIndexer.load(tmp_path / "x.safetensors")
    with pytest.raises(ConfigError, match="cannot read a memory indexer"):
        MemoryIndexer.load(tmp_path / "missing.safetensors")


def test_a_random_memory_indexer_has_the_warm_starts_shape_and_rope(model):
    """`MemoryIndexer.random` (benchmarks: what recall costs) from the config alone: the shape and
    RoPE frequencies of the warm start, its own weights per seed, the caller's random state untouched."""
    warm = MemoryIndexer.from_native(model)
    state = torch.random.get_rng_state()
    a, b = MemoryIndexer.random(model.config), MemoryIndexer.random(model.config, seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert a.config == warm.config and torch.equal(a.inv_freq, warm.inv_freq)
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in warm.state_dict().items()}
    assert torch.equal(a.scorers["1"].wq_a.weight, MemoryIndexer.random(model.config).scorers["1"].wq_a.weight)
    assert not torch.equal(a.scorers["1"].wq_a.weight, b.scorers["1"].wq_a.weight)
    with pytest.raises(ConfigError, match="not CSA layers"):
        MemoryIndexer.random(model.config, layers=[2])


def test_a_recalls_requests_ranked_together_keep_what_each_keeps_alone():
    """The engine hands a step's due recalls each block's ranking key (`FlashMemory.block_ranks`,
    computed where the scores are) and the policy ranks all of them in one sort: every request keeps
    the blocks its chunk probabilities keep alone, ties (equal counts and masses, which coarse
    probabilities make common) going to the lower block as there."""
    from hybridkv.memory.policies import PolicyContext
    g = torch.Generator().manual_seed(11)
    twelfth = FlashMemory.DEFAULT_TAIL_SHARE
    for budget, tail, rank in ((0.15, twelfth, "max"), (0.15, twelfth, "count"), (0.3, 0.2, "max"),
                               (0.5, 0.0, "count"), (1.0, 0.5, "max")):
        policy = FlashMemory(budget, tail_share=tail, rank=rank)
        ctxs, alone = [], []
        for r in range(40):
            bc = 4
            visible = int(torch.randint(1, 300, (1,), generator=g))
            probs = torch.randint(0, 5, (visible,), generator=g).float() / 4     # 0, .25, .5, .75, 1: many ties
            n_blocks = -(-visible // bc) + int(torch.randint(0, 2, (1,), generator=g))   # maybe one block opened since
            extra = {"chunk_probs": probs, "block_chunks": bc}
            alone.append(policy.resident(PolicyContext(str(r), n_blocks, visible * 4, 16, 64, extra=extra)))
            ranks = policy.block_ranks(probs, visible // bc, bc).numpy()
            ctxs.append(PolicyContext(str(r), n_blocks, visible * 4, 16, 64,
                                      extra={"block_ranks": ranks, "visible_chunks": visible, "block_chunks": bc}))
        assert policy.resident_many(ctxs) == alone, (budget, tail, rank)


def test_flashmemory_keeps_the_newest_then_the_densest_blocks_up_to_its_budget():
    policy = FlashMemory(0.4)
    visible = 42                      # 10 complete blocks of 4 chunks, block 10 being filled
    probs = torch.zeros(visible)
    probs[4:7] = 0.9                  # block 1: three chunks above 0.5
    probs[20:22] = 0.8                # block 5: two
    probs[24] = 0.7                   # block 6: one, and a low-mass block 7 below
    probs[28:32] = 0.4
    keep = policy.chunks(probs, visible, 4)
    blocks = sorted({i // 4 for i in torch.nonzero(keep).flatten().tolist()})
    # budget 4 blocks of 11: the newest (a twelfth of the budget, at least one), the two densest, the filling block
    assert blocks == [1, 5, 9, 10]
    assert keep.numel() == visible and int(keep.sum()) == 3 * 4 + 2
    # ties in the count go to the larger summed probability: block 7 (4 × 0.4) over block 3 (empty)
    tie = FlashMemory(0.55, tail_share=0.2)            # 6 of 11 blocks: 5 complete ones, 1 the newest
    blocks = sorted({i // 4 for i in torch.nonzero(tie.chunks(probs, visible, 4)).flatten().tolist()})
    assert blocks == [1, 5, 6, 7, 9, 10]
    # two scores (the engine's first recall: the prompt's last row, the mean over its last rows): their
    # rankings take turns, the first score's best block first; a block both name counts once
    other = torch.zeros(visible)
    other[32:36] = 0.9                # block 8 first, then block 1 (also the first score's best)
    other[4:6] = 0.6
    two = FlashMemory(0.55, tail_share=0.2, turns=(1, 1))    # 5 blocks: the newest and four from the rankings
    keep = two.chunks(torch.stack([probs, other]), visible, 4)
    blocks = sorted({i // 4 for i in torch.nonzero(keep).flatten().tolist()})
    # 1 (first), 8 (second), 5 (first), then the second's next: its 1 is taken, its zeros go in block order
    assert blocks == [0, 1, 5, 8, 9, 10]
    # the default turns take one block from the first ranking, then three from the second: 1; 8, 0, 2
    blocks = torch.nonzero(FlashMemory(0.55, tail_share=0.2).blocks(torch.stack([probs, other]), visible, 4))
    assert blocks.flatten().tolist() == [0, 1, 2, 8, 9, 10]
    with pytest.raises(ConfigError, match="turns"):
        FlashMemory(turns=(0, 0))
    # a context shorter than one block keeps everything
    assert policy.chunks(torch.zeros(3), 3, 4).all()
    assert str(parse_policy("flashmemory")) == "flashmemory-0.15" and parse_policy("flashmemory-0.1").budget == 0.1
    with pytest.raises(ConfigError, match="resident share"):
        parse_policy("flashmemory-1.5")
    # the tail share by name: the newest blocks a recall keeps whatever the scores say
    tail = parse_policy("flashmemory-0.55-tail0.7")      # 4 of the 5 blocks the newest (6-9), then block 1
    assert (tail.budget, tail.tail_share, str(tail)) == (0.55, 0.7, "flashmemory-0.55-tail0.7")
    assert torch.nonzero(tail.blocks(probs, visible, 4)).flatten().tolist() == [1, 6, 7, 8, 9, 10]
    for bad, match in (("flashmemory-0.15-tail1.5", "tail share"), ("flashmemory-0.15-tail1.2.3", "not a number"),
                       ("flashmemory-0.15-tail", "unknown memory policy"),
                       ("random-0.1-tail0.5", "unknown memory policy"), ("random-0.1.2", "not a number")):
        with pytest.raises(ConfigError, match=match):
            parse_policy(bad)


def test_flashmemory_ranks_blocks_by_their_most_probable_chunk_or_by_the_papers_count():
    """The default ranks a block by its most probable chunk (a needle: one chunk far above the rest),
    `-count` by its chunks above 0.5 as FlashMemory's paper does; each breaks ties by the summed
    probability, and the engine's per-block keys give the same blocks."""
    from hybridkv.memory.policies import PolicyContext
    visible = 40                      # 10 complete blocks of 4 chunks
    probs = torch.zeros(visible)
    probs[8] = 0.95                   # block 2: one chunk, the most probable
    probs[20:23] = 0.6                # block 5: three chunks a little above 0.5
    probs[28] = probs[32] = 0.7       # blocks 7 and 8: the same largest chunk, block 8 more mass
    probs[33] = 0.3
    by_max, by_count = parse_policy("flashmemory-0.4"), parse_policy("flashmemory-0.4-count")
    assert (by_max.rank, by_count.rank, str(by_count)) == ("max", "count", "flashmemory-0.4-count")
    assert str(parse_policy("flashmemory-0.3-tail0.5-count")) == "flashmemory-0.3-tail0.5-count"
    assert parse_policy("flashmemory-count").rank == "count" and str(parse_policy("flashmemory")) == "flashmemory-0.15"
    # budget 4 blocks of 11 with the one the next chunk opens: the newest (9), then two by the ranking
    assert torch.nonzero(by_max.blocks(probs, visible, 4)).flatten().tolist() == [2, 8, 9]
    assert torch.nonzero(by_count.blocks(probs, visible, 4)).flatten().tolist() == [5, 8, 9]
    for policy in (by_max, by_count):
        ranks = policy.block_ranks(probs, visible // 4, 4).numpy()
        ctx = PolicyContext("r", 11, visible * 4, 16, 64,
                            extra={"block_ranks": ranks, "visible_chunks": visible, "block_chunks": 4})
        alone = policy.resident(PolicyContext("r", 11, visible * 4, 16, 64,
                                              extra={"chunk_probs": probs, "block_chunks": 4}))
        assert policy.resident(ctx) == alone
    with pytest.raises(ConfigError, match="ranks blocks by"):
        FlashMemory(rank="sum")
    with pytest.raises(ConfigError, match="unknown memory policy"):
        parse_policy("recency-100-count")


def test_train_memory_indexer_labels_trains_validates_and_writes_its_weights(tmp_path):
    from hybridkv.cli import main

    out = tmp_path / "mi"
    out.mkdir()
    argv = ["train-memory-indexer", str(SHIPPED), "--out", str(out), "--labels", str(tmp_path / "labels"),
            "--docs", "3", "--val-docs", "2", "--length", "1024,2048", "--steps", "40", "--batch-positions", "16"]
    assert main(argv) == 0
    report = json.loads((out / "memory_indexer.json").read_text())
    for k in ("native", "oracle", "init", "trained"):
        assert {"f1", "policy_recall", "recency_recall", "resident_share"} <= set(report[k]), k
    assert report["oracle"]["f1"] == 1.0
    assert report["trained"]["f1"] > report["init"]["f1"]        # the warm start is uncalibrated at 0.5
    # the two lengths take turns, in training and in validation, and validation reports each
    names = sorted(p.name for p in (tmp_path / "labels").glob("*.safetensors"))
    assert names == ["doc00000-1024.safetensors", "doc00001-2048.safetensors", "doc00002-1024.safetensors",
                     "doc00003-2048.safetensors", "doc00004-1024.safetensors"]
    assert report["config"]["lengths"] == [1024, 2048]
    assert set(report["by_length"]) == {"1024", "2048"}
    assert report["by_length"]["2048"]["trained"]["resident_share"] > 0
    # 1,024 tokens are 8 blocks, of which 15 % is no complete block: no position counts where blocks
    # are kept; 2,048 tokens' last positions keep one
    assert report["by_length"]["1024"]["trained"]["policy_recall_where_kept"] is None
    assert 0 < report["by_length"]["2048"]["trained"]["policy_recall_where_kept"] <= 1
    assert MemoryIndexer.load(out).config.layers == [1, 3, 5]
    assert report["policy"] == "flashmemory-0.15"
    # measured again under the serving policy: only the validation documents are labelled, and the
    # same weights on the same documents under the same policy measure what training reported
    assert main(["train-memory-indexer", str(SHIPPED), "--out", str(out), "--labels", str(tmp_path / "val-labels"),
                 "--validate-only"]) == 0
    assert sorted(p.name for p in (tmp_path / "val-labels").glob("*.safetensors")) == [
        "doc00003-2048.safetensors", "doc00004-1024.safetensors"]
    again = json.loads((out / "memory_indexer.json").read_text())
    assert not list(out.glob("*.partial"))                 # the report replaced whole
    for k in ("native", "oracle", "init", "trained", "by_length", "train_seconds", "final_loss", "policy"):
        assert again[k] == report[k], k
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["train-memory-indexer", str(SHIPPED), "--out", str(tmp_path), "--validate-only"]) == 2
    assert "no training report" in err.getvalue()
    # the labels are reused: a second run labels nothing
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([*argv, "--steps", "1"]) == 0
    assert "labelled document" not in err.getvalue()
    assert main(["train-memory-indexer", str(tmp_path), "--docs", "1"]) == 2      # no model there
    assert main(["train-memory-indexer", str(SHIPPED), "--length", "2048,2k"]) == 2
    # labels made with another top-p are not reused; a new directory labels with it
    assert main([*argv, "--steps", "1", "--top-p", "0.8"]) == 2
    other = tmp_path / "labels-0.8"
    assert main(["train-memory-indexer", str(SHIPPED), "--out", str(out), "--labels", str(other), "--docs", "1",
                 "--val-docs", "1", "--length", "1024", "--steps", "2", "--batch-positions", "8", "--top-p", "0.8",
                 "--window", "32"]) == 0
    assert {load_labels(p).top_p for p in other.glob("*.safetensors")} == {0.8}
    report = json.loads((out / "memory_indexer.json").read_text())
    assert (report["config"]["top_p"], report["config"]["window"]) == (0.8, 32)
    assert main(["train-memory-indexer", str(SHIPPED), "--top-p", "1.5"]) == 2


def test_the_shipped_model_serves_flashmemory_with_its_own_memory_indexer():
    """`--memory-policy flashmemory` on models/tiny-v4 finds memory_indexer.safetensors beside it."""
    from hybridkv.engine import LLM, SamplingParams
    from hybridkv.tasks.generators import Pools, make_sample
    from hybridkv.tasks.tokenizer import TaskTokenizer

    tok = TaskTokenizer.load(SHIPPED)
    # 4K: 32 complete blocks, of which the policy keeps 5 (at 2K it keeps 2 of 16, and the shipped
    # indexer answers 55 % of pass keys there: `hybridkv eval ... --lengths 2k,4k --samples 20`)
    s = make_sample("passkey", 11, Pools(tok, seed=4), 4096)
    llm = LLM(SHIPPED, memory_policy="flashmemory", num_blocks=72, max_num_seqs=1, max_model_len=4300)
    assert llm.engine.memory.scorer is not None and llm.engine.memory.scorer.config.layers == [1, 3, 5]
    out = llm.generate([s.prompt], SamplingParams(max_tokens=8, stop_token_ids=[tok.eos_id]))[0]
    assert llm.engine.stats.pages_evicted > 0
    assert tok.decode(out.output_ids).strip().rstrip(".") == s.answers[0]
    llm.close()
