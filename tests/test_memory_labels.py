"""FlashMemory's labels from the model itself: each CSA layer's top-p picks among its top-k, the
layer vote, the causal window targets, and the label file."""

from pathlib import Path

import pytest
import torch

from hybridkv.errors import TrainingError
from hybridkv.train.memory_labels import (DocumentLabels, label_sequence, labels_top_p, layer_picks, load_labels,
                                    save_labels, votes_from_capture, window_targets)

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "tiny-v4"


def test_a_layer_picks_the_top_p_prefix_of_its_top_k_with_the_crossing_entry():
    scores = torch.tensor([[3.0, 1.0, 2.0, 0.5, 9.0],
                           [3.0, 1.0, 2.0, 0.5, 9.0],
                           [3.0, 1.0, 2.0, 0.5, 9.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0]])
    visible = torch.tensor([4, 4, 1, 0])       # entry 4 (the best score) is not visible to any query
    # top-3 of the visible [3, 1, 2, 0.5] are entries 0, 2, 1; softmax over those three only:
    # 0.665, 0.245, 0.090. Mass before each: 0, 0.665, 0.910
    picks = layer_picks(scores, visible, topk=3, top_p=0.6)
    assert picks[0].tolist() == [True, False, False, False, False]      # 0 crosses 0.6 by itself
    wider = layer_picks(scores, visible, topk=3, top_p=0.7)
    assert wider[0].tolist() == [True, False, True, False, False]       # 2 crosses 0.7
    assert layer_picks(scores, visible, topk=3, top_p=1.0)[1].tolist() == [True, True, True, False, False]
    assert picks[2].tolist() == [True, False, False, False, False]      # sees one entry: picks it
    assert not picks[3].any()                                            # sees none: picks none


def test_votes_count_the_layers_that_pick_a_chunk_and_the_csr_lists_them_in_order():
    # two layers, one head of dim 2, weight 1: score[t, j] = relu(q_t · k_j)
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 2.0]]])
    q_a = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]], [[0.0, 1.0]], [[0.0, 3.0]]])     # layer a's queries
    q_b = torch.tensor([[[0.0, 1.0]], [[0.0, 1.0]], [[1.0, 0.0]], [[3.0, 0.0]]])
    w = torch.ones(4, 1)
    captured = {1: dict(q=q_a, w=w, keys=keys), 3: dict(q=q_b, w=w, keys=keys)}
    # ratio 1: query t sees entries 0..t. topk 4, top_p 0.5
    pointers, indices, votes = votes_from_capture(captured, ratio=1, topk=4, top_p=0.5, tile=3)
    rows = [dict(zip(indices[pointers[t]:pointers[t + 1]].tolist(), votes[pointers[t]:pointers[t + 1]].tolist()))
            for t in range(4)]
    # t=0 sees entry 0 only: both layers pick it
    assert rows[0] == {0: 2}
    # t=1, layer a scores (1, 0): picks 0; layer b scores (0, 1): picks 1
    assert rows[1] == {0: 1, 1: 1}
    # t=2, a and b score (0, 1, 1) and (1, 0, 1): softmax of the tie puts 0.42 on each of the two
    # best; the first (lower index, topk's order) does not reach 0.5, so the second is picked too
    assert rows[2] == {1: 1, 2: 2, 0: 1}
    # t=3: a scores (0, 3, 3, 6), b (3, 0, 3, 6): entry 3 holds 0.91 for both
    assert rows[3] == {3: 2}
    assert indices.dtype == torch.int32 and votes.dtype == torch.uint8 and pointers[-1] == indices.numel()
    for t in range(4):
        row = indices[pointers[t]:pointers[t + 1]].tolist()
        assert row == sorted(row)


def _labels(rows: list[dict[int, int]], ratio: int = 1) -> DocumentLabels:
    pointers, indices, votes = [0], [], []
    for r in rows:
        for c in sorted(r):
            indices.append(c)
            votes.append(r[c])
        pointers.append(len(indices))
    n = len(rows)
    return DocumentLabels(torch.arange(n), torch.tensor(pointers), torch.tensor(indices, dtype=torch.int32),
                          torch.tensor(votes, dtype=torch.uint8), {1: torch.zeros(n, 4)}, {1: torch.zeros(n, 2)},
                          ratio, 4, 0.6, {})


def test_window_targets_union_the_next_positions_votes_but_only_chunks_that_exist_at_t():
    lab = _labels([{0: 1}, {0: 2, 1: 1}, {1: 2, 2: 3}, {3: 2}, {0: 3}])
    assert window_targets(lab, 0, vote=1, window=2).tolist() == [0]          # chunk 1 comes into being at t=1
    assert window_targets(lab, 1, vote=1, window=2).tolist() == [0, 1]
    assert window_targets(lab, 1, vote=2, window=3).tolist() == [0, 1]       # 2 (vote 3 at t=2) is not visible at 1
    assert window_targets(lab, 2, vote=2, window=3).tolist() == [0, 1, 2]    # t=2..4: 1, 2, 3 (not yet), 0
    assert window_targets(lab, 4, vote=3, window=64).tolist() == [0]         # the window stops at the end


@pytest.fixture(scope="module")
def shipped_labels():
    from hybridkv.tasks.generators import Pools, make_sample
    from hybridkv.tasks.tokenizer import TaskTokenizer
    from hybridkv.train.export import float_model

    model = float_model(SHIPPED)
    tok = TaskTokenizer.load(SHIPPED)
    ids = make_sample("passkey", 3, Pools(tok, seed=5), 1024).prompt
    return model, ids, label_sequence(model, ids, meta={"source": "test"})


def test_labels_of_the_shipped_model_are_causal_votes_of_its_three_csa_layers(shipped_labels, tmp_path):
    model, ids, lab = shipped_labels
    csa = [i for i, b in enumerate(model.layers) if getattr(b.attn, "indexer", None) is not None]
    assert lab.layers == csa == [1, 3, 5] and lab.ratio == 4 and lab.topk == 64
    for t in range(len(ids)):
        chunks, votes = lab.row(t)
        vis = (t + 1) // 4
        assert (chunks < vis).all()                          # never a chunk completed after t
        assert ((votes >= 1) & (votes <= 3)).all()
        if vis:
            # every layer picks at least one chunk, so the votes add up to at least 3
            assert int(votes.sum()) >= 3
    # the stored keys are the indexer keys as cached: FP4 values, exact in bf16
    n = len(ids) // 4
    assert all(lab.keys[i].shape == (n, model.config.index_head_dim) for i in csa)
    assert all(lab.x[i].shape == (len(ids), model.config.hidden_size) for i in csa)
    again = load_labels(save_labels(lab, tmp_path / "doc.safetensors"))
    for name in ("input_ids", "pointers", "indices", "votes"):
        assert torch.equal(getattr(again, name).long(), getattr(lab, name).long()), name
    assert all(torch.equal(again.keys[i], lab.keys[i]) and torch.equal(again.x[i], lab.x[i]) for i in csa)
    assert again.meta["source"] == "test" and again.top_p == 0.6


def test_the_capture_leaves_the_forward_unchanged(shipped_labels):
    from hybridkv.train.forward import TrainOptions, train_forward

    model, ids, _ = shipped_labels
    x = torch.tensor([ids[:300]])
    with torch.no_grad():
        plain = train_forward(model, x, TrainOptions(dense_indexer=False, qat_indexer=True, kl_queries=1)).stream
        seen = train_forward(model, x, TrainOptions(dense_indexer=False, qat_indexer=True, kl_queries=1,
                                                    capture_indexer=True))
    assert torch.equal(plain, seen.stream) and sorted(seen.aux.captured) == [1, 3, 5]


def test_a_label_file_that_is_not_one_is_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"a": torch.zeros(2)}, str(other), metadata={"format": "something-else"})
    for read in (load_labels, labels_top_p):
        with pytest.raises(TrainingError, match="not a memory-label file"):
            read(other)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    for read in (load_labels, labels_top_p):
        with pytest.raises(TrainingError, match="cannot read memory labels"):
            read(broken)
    lab = _labels([{0: 1}, {0: 2}])
    path = save_labels(lab, tmp_path / "ok.safetensors")
    bad = _labels([{0: 1}, {0: 2}])
    bad.pointers = torch.tensor([0, 1, 5])
    save_labels(bad, tmp_path / "bad.safetensors")
    with pytest.raises(TrainingError, match="CSR does not match"):
        load_labels(tmp_path / "bad.safetensors")
    assert load_labels(path).indices.tolist() == [0, 0]
    assert labels_top_p(path) == lab.top_p
