"""The training forward computes what the inference model serves, and trains what it should."""

import pytest
import torch
from engine_helpers import rel

from hybridkv.model import ContiguousKV, ForwardBatch
from hybridkv.train.forward import TrainOptions, train_forward
from hybridkv.weights import load_model


@pytest.fixture(scope="module")
def tiny(fixtures):
    model, cfg = load_model(fixtures / "v4-tiny")
    return model, cfg


def _inference_logits(model, ids):
    kv = ContiguousKV(model.config)
    with torch.no_grad():
        h = model(ids, ForwardBatch.build([(kv, 0, ids.shape[0])]))
        return model.logits(h), model.mtp_logits(model.mtp_forward(h, torch.cat([ids[1:], ids[:1] * 0]),
                                                                    ForwardBatch.build([(ContiguousKV(model.config),
                                                                                         0, ids.shape[0])])))


def test_sparse_training_forward_matches_inference(tiny):
    """With the indexer selecting top-k (16 of up to 75 entries here) and its FP4 round trips on,
    the training forward's logits and MTP logits equal the inference model's for each sequence of
    a batch."""
    model, cfg = tiny
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, cfg.vocab_size, (2, 300), generator=gen)
    with torch.no_grad():
        out = train_forward(model, ids, TrainOptions(dense_indexer=False, qat_indexer=True))
        logits = model.logits(out.stream).view(2, 300, -1)
        mtp = model.mtp_logits(out.mtp_streams[0]).view(2, 300, -1)
    for i in range(2):
        ref, ref_mtp = _inference_logits(model, ids[i])
        assert rel(logits[i], ref) < 1e-3  # summation order, amplified by FP8 rounding flips
        assert (logits[i].argmax(-1) == ref.argmax(-1)).float().mean() >= 0.99  # random weights: near ties
        # the last row's next token is padding in both
        assert rel(mtp[i, :-1], ref_mtp[:-1]) < 1e-3  # FP8 rounding flips of tiny differences


def test_chained_mtp_pass_is_the_engines_second_draft(tiny):
    """`mtp_chain`: the training forward's chained row t equals the inference MTP block run at t + 1
    on its own output of row t and token t + 2, over a window holding its rows of positions 0..t
    computed from the main model's streams (what the engine's chain reads), at positions inside the
    first window, across a window boundary and past it."""
    model, cfg = tiny
    ids = torch.randint(2, cfg.vocab_size, (1, 300), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = train_forward(model, ids, TrainOptions(dense_indexer=False, qat_indexer=True, mtp_chain=1))
        assert len(out.mtp_streams) == 2
        chained = model.mtp_logits(out.mtp_streams[1])
        seq = ids[0]
        kv = ContiguousKV(model.config)
        h = model(seq, ForwardBatch.build([(kv, 0, seq.shape[0])]))
        nxt = torch.cat([seq[1:], seq[:1] * 0])
        for t in (5, 127, 128, 200, 296):
            mkv = ContiguousKV(model.config)
            first = model.mtp_forward(h[: t + 1], nxt[: t + 1], ForwardBatch.build([(mkv, 0, t + 1)]))
            second = model.mtp_forward(first[t:], seq[t + 2: t + 3], ForwardBatch.build([(mkv, t + 1, 1)]))
            ref = model.mtp_logits(second)[0]
            assert rel(chained[t], ref) < 1e-3, t     # FP8 rounding flips of tiny differences
            assert chained[t].argmax() == ref.argmax()


def test_chained_mtp_pass_trains_only_what_it_reads(tiny):
    """With only the MTP block trainable (`train.loop.freeze_all_but`) and the trunk run without
    gradients, the chained pass's loss alone reaches the MTP block's parameters, the attention's
    among them (through its own row and through the rows of the pass before)."""
    from hybridkv.train.loop import freeze_all_but
    from hybridkv.train.losses import LossWeights, compute_losses
    model, cfg = tiny
    model = model.train()
    ids = torch.randint(2, cfg.vocab_size, (2, 200), generator=torch.Generator().manual_seed(4))
    trainable = freeze_all_but(model, "mtp.")
    try:
        out = train_forward(model, ids, TrainOptions(dense_indexer=False, mtp_chain=1, frozen_trunk=True))
        assert not out.stream.requires_grad
        _, logs = compute_losses(model, ids, torch.zeros_like(ids, dtype=torch.bool), out, LossWeights())
        assert {"mtp0", "mtp1"} <= set(logs) and logs["mtp1"] > 0
        chained = torch.nn.functional.cross_entropy(model.mtp_logits(out.mtp_streams[1]).view(2, 200, -1)[:, :-3]
                                                    .flatten(0, 1), ids[:, 3:].flatten())
        chained.backward()
        grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        assert all(n.startswith("mtp.") for n in grads), sorted(grads)[:5]
        assert {"mtp.0.attn.wkv.weight", "mtp.0.e_proj.weight", "mtp.0.h_proj.weight"} <= grads
        assert trainable == {n for n, p in model.named_parameters() if p.requires_grad}
    finally:
        model.zero_grad(set_to_none=True)
        for p in model.parameters():
            p.requires_grad_(True)
        model.eval()


def test_gradients_reach_every_trained_parameter(tiny):
    """LM + MTP + indexer KL: every float parameter gets a finite gradient; the indexer gets its
    gradient from the KL only (its inputs are detached)."""
    model, cfg = tiny
    model = model.train()
    ids = torch.randint(2, cfg.vocab_size, (1, 260), generator=torch.Generator().manual_seed(1))
    for dense in (True, False):
        model.zero_grad(set_to_none=True)
        out = train_forward(model, ids, TrainOptions(dense_indexer=dense, kl_queries=64))
        lm = torch.nn.functional.cross_entropy(model.logits(out.stream)[:-1], ids[0, 1:])
        lm.backward(retain_graph=True)
        idx_params = [p for n, p in model.named_parameters() if ".indexer." in n]
        assert all(p.grad is None or not p.grad.any() for p in idx_params)
        assert out.aux.indexer_kl, "no indexer KL term"
        sum(out.aux.indexer_kl.values()).backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in idx_params)
        missing = [n for n, p in model.named_parameters()
                   if p.requires_grad and not n.startswith("mtp.") and "gate.bias" not in n
                   and (p.grad is None or not torch.isfinite(p.grad).all())]
        assert not missing, missing
        counts = out.aux.expert_counts
        assert set(counts) == set(range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers))
        assert all(int(c.sum()) == 260 * cfg.num_experts_per_tok for c in counts.values())
    model.eval()


def test_dense_forward_reports_indexer_recall(tiny):
    """The DSA warm-up view measures how much of the main attention's top-k the indexer finds."""
    model, cfg = tiny
    ids = torch.randint(2, cfg.vocab_size, (1, 400), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = train_forward(model, ids, TrainOptions(dense_indexer=True, qat_indexer=True, kl_queries=64),
                            torch.Generator().manual_seed(0))
    csa = [i for i in range(cfg.num_hidden_layers) if cfg.layer_ratio(i) == 4]
    assert sorted(out.aux.indexer_recall) == csa
    assert all(0.0 <= r <= 1.0 for r in out.aux.indexer_recall.values())


@pytest.mark.parametrize("name", ["v41-tiny", "v41-tiny-fp8"])
def test_v41_training_forward_matches_inference_layer_by_layer(fixtures, name):
    """V4.1 (Full / Reuse / Reindex layers, candidate pool, single-pass mHC): each block of the
    training forward, fed the inference model's stream and pre mix, gives the inference block's
    output (≤ 1e-5). Free running, V4.1's FP4/FP8 round trips and top-k boundaries amplify those
    small differences (to ~1e-3 over the stack), so the end-to-end check is on the argmax."""
    from hybridkv.model.mhc import identity_pre
    from hybridkv.train.forward import Aux, _Ctx, block_train_single_pass
    from hybridkv.train.export import float_model
    model = float_model(fixtures / name)
    cfg = model.config
    ids = torch.randint(2, cfg.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    ref = []
    with torch.no_grad():
        final = model(ids[0], ForwardBatch.build([(ContiguousKV(cfg), 0, 300)]),
                      after_layer=lambda i, h, pre: ref.append((h.clone(), pre.clone())))
        opts = TrainOptions(dense_indexer=False, qat_indexer=True)
        ctx = _Ctx(1, 300, ids.device, opts, Aux(), None)
        flat = ids.reshape(-1)
        h = model.embed(flat).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pre = identity_pre(h)
        for i, layer in enumerate(model.layers):
            out, out_pre = block_train_single_pass(layer, h, pre, flat, ctx)
            assert rel(out, ref[i][0]) < 1e-5, (i, cfg.layer_kind(i), rel(out, ref[i][0]))
            h, pre = ref[i]
        free = model.logits(train_forward(model, ids, opts).stream)
        want = model.logits(final)
    assert (free.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


def test_v41_gradients(fixtures):
    from hybridkv.train.export import float_model
    model = float_model(fixtures / "v41-tiny").train()
    ids = torch.randint(2, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1))
    for dense in (True, False):
        model.zero_grad(set_to_none=True)
        out = train_forward(model, ids, TrainOptions(dense_indexer=dense, kl_queries=32))
        torch.nn.functional.cross_entropy(model.logits(out.stream)[:-1], ids[0, 1:]).backward(retain_graph=True)
        idx = [p for n, p in model.named_parameters() if ".indexer." in n]
        assert all(p.grad is None or not p.grad.any() for p in idx)
        assert out.aux.indexer_kl
        sum(out.aux.indexer_kl.values()).backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in idx)


@pytest.mark.parametrize("dense", [True, False])
def test_v41_reuse_layers_train_the_indexer_whose_topk_they_read(fixtures, dense):
    """With `reuse_layers_train_indexer`, each V4.1 Reuse layer adds a KL term (its own attention
    against the last index source's scores), in the warm-up and on the selected set; the terms
    move only the indexers (their targets are detached), so the model's gradients are those of the
    plain forward."""
    from hybridkv.train.export import float_model
    model = float_model(fixtures / "v41-tiny").train()
    cfg = model.config
    ids = torch.randint(2, cfg.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1))
    grads, kls = {}, {}
    for reuse in (False, True):
        model.zero_grad(set_to_none=True)
        opts = TrainOptions(dense_indexer=dense, kl_queries=32, reuse_layers_train_indexer=reuse)
        out = train_forward(model, ids, opts, torch.Generator().manual_seed(0))
        loss = torch.nn.functional.cross_entropy(model.logits(out.stream)[:-1], ids[0, 1:])
        (loss + sum(out.aux.indexer_kl.values())).backward()
        grads[reuse] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        kls[reuse] = out.aux.indexer_kl
    reuse_layers = [i for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == "reuse"]
    assert reuse_layers and not set(reuse_layers) & set(kls[False])
    assert set(kls[True]) == set(kls[False]) | set(reuse_layers)
    assert all(torch.isfinite(kls[True][i]) and kls[True][i] >= 0 for i in reuse_layers)
    for name, g in grads[False].items():
        if ".indexer." not in name:
            assert torch.equal(g, grads[True][name]), name
    assert any(not torch.equal(g, grads[True][n]) for n, g in grads[False].items() if ".indexer." in n)
