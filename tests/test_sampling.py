"""The sampler (hybridkv.engine.sampling): a step's unseeded sampled rows drawn together, each from
its own temperature, top-k and top-p; seeded rows from their own generators, as alone."""

import math

import torch

from hybridkv.engine.sampling import SamplingParams, draw_rows, filtered_probs, filtered_probs_rows


def one_row(logits, p):
    """The distribution of one row written out directly (the definition the rows must match)."""
    scaled = logits.double() / p.temperature
    if p.top_k:
        kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if p.top_p < 1:
        order = torch.argsort(scaled, descending=True)
        probs = torch.softmax(scaled[order], -1)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        scaled[order[drop]] = -math.inf
    return torch.softmax(scaled, -1).float()


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=5),
          SamplingParams(temperature=2.0, top_p=0.6), SamplingParams(temperature=0.8, top_k=7, top_p=0.9),
          SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=1.0, top_k=1000)]


def test_rows_under_mixed_parameters_match_each_rows_definition():
    logits = torch.randn(len(PARAMS), 50, generator=torch.Generator().manual_seed(0)) * 3
    rows = filtered_probs_rows(logits, PARAMS)
    for i, p in enumerate(PARAMS):
        want = one_row(logits[i], p)
        assert torch.allclose(rows[i], want, atol=1e-6), p
        assert torch.equal(rows[i] > 0, want > 0), p                 # the same tokens cut
        assert torch.allclose(filtered_probs(logits[i], p), want, atol=1e-6)
    same = [SamplingParams(temperature=0.7, top_k=3)] * 3          # one temperature and k for all
    assert torch.allclose(filtered_probs_rows(logits[:3], same), torch.stack([one_row(x, same[0]) for x in logits[:3]]),
                          atol=1e-6)


def test_unseeded_rows_are_drawn_together_from_their_own_distributions(monkeypatch):
    """Many unseeded rows in one step: one multinomial draw for all of them, each row's tokens
    inside its top-k / top-p cut and at its distribution's frequencies."""
    torch.manual_seed(1)
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0])
    kinds = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2),
             SamplingParams(temperature=0.5, top_p=0.7), SamplingParams(temperature=0.0)]
    n = 3000
    params = [kinds[i % 4] for i in range(4 * n)]
    logits = base.repeat(4 * n, 1)
    calls = []
    multinomial = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: calls.append(a[0].shape) or multinomial(*a, **k))
    tokens = draw_rows(logits, params, [None] * len(params)).tokens
    assert calls == [(3 * n, 8)]                     # the greedy rows take the argmax, the others one draw
    for j, p in enumerate(kinds):
        got = tokens[j::4]
        if p.temperature == 0:
            assert bool((got == 0).all())
            continue
        want = one_row(base, p)
        freq = torch.bincount(got, minlength=8).float() / n
        assert bool((freq[want == 0] == 0).all()), p            # never a token the cuts removed
        # within 5 standard errors of each probability
        assert bool(((freq - want).abs() <= 5 * (want * (1 - want) / n).sqrt() + 1e-9).all()), (p, freq, want)


def test_a_seeded_row_draws_as_alone_whatever_else_the_step_samples():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=0.9, top_p=0.8, seed=11)
    alone = draw_rows(logits[2:3], [p], [torch.Generator().manual_seed(11)]).tokens[0]
    others = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=0.5)]
    gens = [None, None, torch.Generator().manual_seed(11), None, None]
    mixed = draw_rows(logits, others[:2] + [p] + others[2:], gens).tokens
    assert mixed[2] == alone and mixed[1] == logits[1].argmax()


def test_fixed_shape_filter_equals_the_per_row_filter():
    """`filtered_probs_fixed` (parameters as tensors, for CUDA graphs) against `filtered_probs_rows`:
    temperatures, top-k (ties with the k-th value kept, k past the vocabulary), top-p, both, neither."""
    from hybridkv.engine.sampling import filtered_probs_fixed

    torch.manual_seed(0)
    logits = torch.randn(7, 50) * 3
    logits[2, :10] = 1.0
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=1.3, top_k=12, top_p=0.8), SamplingParams(temperature=0.5, top_p=0.3),
              SamplingParams(temperature=2.0, top_k=100), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0, top_k=3)]
    want = filtered_probs_rows(logits, params)
    got = filtered_probs_fixed(logits, *(torch.tensor([getattr(p, a) for p in params], dtype=torch.float32)
                                         for a in ("temperature", "top_k", "top_p")))
    assert torch.equal(got > 0, want > 0) and torch.allclose(got, want, atol=1e-7)


def test_draws_by_uniforms_invert_the_cumulative_weights():
    """`draw_with_uniforms`: the token whose cumulative weight first passes u · total, never a token
    of weight 0 (u at 0 or as close to 1 as float32 goes), unnormalised rows."""
    from hybridkv.engine.sampling import draw_with_uniforms

    w = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0], [5.0, 0.0, 0.0, 0.0, 0.0]])
    assert draw_with_uniforms(w, torch.tensor([0.0, 0.0, 0.0])).tolist() == [1, 4, 0]
    assert draw_with_uniforms(w, torch.tensor([1 - 2 ** -24] * 3)).tolist() == [3, 4, 0]
    assert draw_with_uniforms(w, torch.tensor([0.2499, 0.5, 0.5])).tolist() == [1, 4, 0]
    assert draw_with_uniforms(w, torch.tensor([0.25, 0.5, 0.5])).tolist() == [3, 4, 0]


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    """top_p = 1e-320 is valid (in (0, 1]) but 0 in float32: both filters keep the most likely token
    alone (before, every token was cut and the softmax gave NaN, which failed the whole step)."""
    from hybridkv.engine.sampling import filtered_probs_fixed

    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    params = [SamplingParams(temperature=1.0, top_p=1e-320)] * 3
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), 40).float()
    assert torch.equal(filtered_probs_rows(logits, params), one_hot)
    ones = torch.ones(3)
    assert torch.equal(filtered_probs_fixed(logits, ones, 0 * ones, torch.full((3,), 1e-320)), one_hot)


def test_a_temperature_too_small_for_float32_samples_greedily():
    """A temperature below 1e-5 becomes 0 when validated (as in vLLM): the draw is the argmax, with
    or without a seed; a negative or NaN temperature is refused."""
    import pytest

    from hybridkv.errors import RequestError

    logits = torch.randn(2, 30)
    for t in (1e-320, 1e-40, 9e-6):
        params = [SamplingParams(temperature=t), SamplingParams(temperature=t, seed=4)]
        for p in params:
            p.validate()
            assert p.temperature == 0.0
        gens = [None, torch.Generator().manual_seed(4)]
        assert [s.token_id for s in draw_rows(logits, params, gens).host()] == logits.argmax(-1).tolist()
    for bad in (-1.0, float("nan")):
        with pytest.raises(RequestError, match="temperature"):
            SamplingParams(temperature=bad).validate()
