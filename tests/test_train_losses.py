"""The training losses' answer terms: the closing tokens of a completion and their extra weight."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridkv.model import Transformer
from hybridkv.presets import load_config
from hybridkv.tasks.generators import Pools, training_example
from hybridkv.tasks.tokenizer import TaskTokenizer
from hybridkv.train.forward import TrainOptions, train_forward
from hybridkv.train.init import init_weights
from hybridkv.train.losses import LossWeights, closing_targets, compute_losses

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "tiny-v4"


def test_closing_targets_are_the_last_two_supervised_tokens():
    sup = torch.tensor([[0, 0, 1, 1, 1, 1],
                        [0, 0, 0, 0, 1, 1],
                        [0, 0, 0, 0, 0, 1],
                        [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    want = torch.tensor([[0, 0, 0, 0, 1, 1],
                         [0, 0, 0, 0, 1, 1],
                         [0, 0, 0, 0, 0, 1],
                         [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(closing_targets(sup), want)


@pytest.fixture(scope="module")
def pools():
    return Pools(TaskTokenizer.load(SHIPPED), seed=0)


@pytest.mark.parametrize("task", ["niah_single_3", "niah_multikey_1", "passkey", "vt", "copy"])
def test_closing_targets_of_a_training_example_are_period_and_eos(pools, task):
    tok = pools.tok
    ids, sup = training_example(3, pools, 512, {task: 1.0})
    closing = closing_targets(torch.from_numpy(sup)[None])[0].numpy()
    assert closing.sum() == 2 and sup[closing].all()
    period, eos = ids[closing]
    assert tok.decode([int(period)]).strip() == "." and eos == tok.eos_id


def test_answer_end_weight_adds_the_closing_tokens_loss(fixtures):
    cfg = load_config(fixtures / "v4-tiny")
    model = Transformer(cfg, dtype=torch.float32)
    init_weights(model, seed=0)
    ids = torch.randint(2, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    sup = torch.zeros(2, 64, dtype=torch.bool)
    sup[0, -6:] = True
    sup[1, -3:] = True

    with torch.no_grad():
        out = train_forward(model, ids, TrainOptions(dense_indexer=False))
        base, logs = compute_losses(model, ids, sup, out, LossWeights(answer=2.0))
        weighted, _ = compute_losses(model, ids, sup, out, LossWeights(answer=2.0, answer_end=3.0))
        logits = model.logits(out.stream).view(2, 64, -1)
    # the closing targets are the last two tokens of each row: predicted from positions 61 and 62
    ce = F.cross_entropy(logits[:, -3:-1].reshape(4, -1).float(), ids[:, -2:].reshape(-1))
    assert logs["answer_end"] == pytest.approx(float(ce), rel=1e-5)
    assert float(weighted - base) == pytest.approx(3.0 * logs["answer_end"], rel=1e-4)
    right = (logits[:, -3:-1].argmax(-1) == ids[:, -2:]).float().mean()
    assert logs["answer_end_acc"] == pytest.approx(float(right))
    # the term has a gradient of its own: the weight changes the head's gradient
    grads = []
    for end_weight in (0.0, 1.0):
        model.zero_grad()
        out = train_forward(model, ids, TrainOptions(dense_indexer=False), torch.Generator().manual_seed(0))
        compute_losses(model, ids, sup, out, LossWeights(answer_end=end_weight))[0].backward()
        grads.append(model.head.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])
