"""The mHC kernels against the reference mixing and Sinkhorn."""

import pytest
import torch

from helpers import rel_rms
from hybridkv.ops.mhc import reference


def _inputs(t, hc, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hc, dim, generator=g)
    fn = torch.randn(24, hc * dim, generator=g) * 0.05
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g) * 0.1
    return x, fn, scale, base, torch.randn(t, dim, generator=g)


# (3, 96): one program per token; (2, 1000): rows split into column chunks, the last one ragged
@pytest.mark.parametrize("t,dim", [(3, 96), (2, 1000)])
def test_pre_and_post(device, t, dim):
    from hybridkv.ops.mhc import triton as kernels
    hc = 4
    x, fn, scale, base, f = _inputs(t, hc, dim)
    assert (kernels.column_split(t, dim)[2] > 1) == (dim == 1000)
    mixes = x.flatten(1) @ fn.T
    y_ref, post_ref, comb_ref = reference.mhc_pre(x, mixes, scale, base, 20, 1e-6, 1e-6)
    dv = lambda a: a.to(device)  # noqa: E731
    y, post, comb = kernels.mhc_pre(dv(x), dv(mixes), dv(scale), dv(base), 20, 1e-6, 1e-6)
    assert rel_rms(y_ref, y.cpu()) <= 1e-3 and rel_rms(post_ref, post.cpu()) <= 1e-3
    assert rel_rms(comb_ref, comb.cpu()) <= 1e-3
    assert torch.allclose(comb.cpu().sum(-2), torch.ones(t, hc), atol=1e-4)
    out = kernels.mhc_post(dv(f), dv(x), post, comb).cpu()
    assert rel_rms(reference.mhc_post(f, x, post_ref, comb_ref), out) <= 1e-3


def test_a_token_mixes_the_same_alone_and_in_a_large_batch(device):
    """Split into column chunks (one token) or not (140 tokens), a token's outputs are bit-identical:
    the split changes which program computes a column, not the order of any sum."""
    from hybridkv.ops.mhc import triton as kernels
    hc, dim = 4, 1000
    x, fn, scale, base, f = [a.to(device) for a in _inputs(140, hc, dim, seed=1)]
    assert kernels.column_split(1, dim)[2] > 1 and kernels.column_split(140, dim)[2] == 1
    mixes = x.flatten(1) @ fn.T
    many = kernels.mhc_pre(x, mixes, scale, base, 20, 1e-6, 1e-6)
    one = kernels.mhc_pre(x[7:8], mixes[7:8], scale, base, 20, 1e-6, 1e-6)
    for a, b in zip(one, many):
        assert torch.equal(a, b[7:8])
    post, comb = many[1], many[2]
    assert torch.equal(kernels.mhc_post(f[7:8], x[7:8], post[7:8], comb[7:8]),
                       kernels.mhc_post(f, x, post, comb)[7:8])


# (3, 96): 384 flat columns, two mix chunks, the last ragged; (11, 1000): tokens past one program's 8
@pytest.mark.parametrize("t,dim,dtype", [(3, 96, torch.float32), (11, 1000, torch.bfloat16)])
def test_pre_with_the_mixes_from_fn(device, t, dim, dtype):
    """`mhc_pre_fn`: the raw mixes and the sum of squares as per-chunk partial sums, added by the
    pre kernel, against the reference with the GEMM's mixes; `raw_mixes` against the GEMM."""
    from hybridkv.ops.mhc import triton as kernels
    hc = 4
    x, fn, scale, base, _ = _inputs(t, hc, dim, seed=2)
    x = x.to(dtype)
    flat = x.flatten(1).double()
    mixes = (flat @ fn.double().T).float()
    y_ref, post_ref, comb_ref = reference.mhc_pre(x, mixes, scale, base, 20, 1e-6, 1e-6)
    dv = lambda a: a.to(device)  # noqa: E731
    y, post, comb = kernels.mhc_pre_fn(dv(x), dv(fn), dv(scale), dv(base), 20, 1e-6, 1e-6)
    tol = 1e-3 if dtype == torch.float32 else 8e-3        # y is rounded to bf16
    assert rel_rms(y_ref.float(), y.cpu().float()) <= tol
    assert rel_rms(post_ref, post.cpu()) <= 1e-4 and rel_rms(comb_ref, comb.cpu()) <= 1e-4
    raw, ss = kernels.raw_mixes(dv(x.flatten(1)), dv(fn))
    assert rel_rms(mixes, raw.cpu()) <= 1e-5
    assert torch.allclose(ss.cpu().double(), flat.square().sum(-1), rtol=1e-5)


def test_the_model_takes_the_fn_path_outside_deterministic_mode(device, monkeypatch):
    """`hc_pre` and the head's mixes from the kernels at every size outside deterministic mode
    (partial sums up to `MAX_PARTIAL_TOKENS` tokens, `mixes_kernel` beyond), from the GEMM in it;
    the results agree."""
    from hybridkv.model.mhc import _mixes, hc_pre
    from hybridkv.ops import mhc as ops
    from hybridkv.ops.backend import deterministic
    from hybridkv.ops.mhc import triton as kernels
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    hc, dim = 4, 64
    x, fn, scale, base, _ = [a.to(device) for a in _inputs(kernels.MAX_PARTIAL_TOKENS + 1, hc, dim, seed=3)]
    assert ops.fn_in_kernels(x[:-1], fn) and ops.fn_in_kernels(x, fn)
    with deterministic():
        assert not ops.fn_in_kernels(x, fn)
        gemm = hc_pre(x, fn, scale, base, 20, 1e-6, 1e-6)
    few = hc_pre(x[:5], fn, scale, base, 20, 1e-6, 1e-6)
    many = hc_pre(x, fn, scale, base, 20, 1e-6, 1e-6)
    for a, b, c in zip(few, many, gemm):
        assert rel_rms(b[:5].cpu().float(), a.cpu().float()) <= 1e-5
        assert rel_rms(c.cpu().float(), b.cpu().float()) <= 1e-5
    head_fn = fn[:hc]
    assert rel_rms(_mixes(x, head_fn, 1e-6)[:5].cpu(), _mixes(x[:5], head_fn, 1e-6).cpu()) <= 1e-5


@pytest.mark.parametrize("t,dim,dtype", [(3, 96, torch.float32), (11, 1000, torch.bfloat16), (70, 200, torch.float32)])
def test_head_collapse(device, t, dim, dtype, monkeypatch):
    """`mhc_head` (the collapse before the LM head: the hc pre mixes alone, σ + eps, no Sinkhorn) against
    the reference math with the GEMM's mixes, at decode sizes and past `MAX_PARTIAL_TOKENS`; and
    `hc_head` takes it where the kernels compute the mixes."""
    from hybridkv.model.mhc import hc_head
    from hybridkv.ops.mhc import triton as kernels
    hc = 4
    x, fn, scale, base, _ = _inputs(t, hc, dim, seed=8)
    x, fn, scale, base = x.to(dtype), fn[:hc].contiguous(), scale[:1].contiguous(), base[:hc].contiguous()
    flat = x.flatten(1).double()
    mixes = (flat @ fn.double().T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(mixes * scale.double() + base.double()) + 1e-6
    ref = (pre.unsqueeze(-1) * x.double()).sum(1)
    dv = lambda a: a.to(device)  # noqa: E731
    y = kernels.mhc_head(dv(x), dv(fn), dv(scale), dv(base), 1e-6, 1e-6)
    assert y.dtype == dtype and y.shape == (t, dim)
    tol = 1e-5 if dtype == torch.float32 else 8e-3        # y is rounded to bf16
    assert rel_rms(ref.float(), y.cpu().float()) <= tol
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    assert torch.equal(hc_head(dv(x), dv(fn), dv(scale), dv(base), 1e-6, 1e-6), y)


# (70, 384): two token tiles, the last ragged, one split; (200, 1000): four tiles, two splits of 64-column
# steps (MIXES_SPLIT 512 here), the last split ragged
@pytest.mark.parametrize("t,k,dtype", [(70, 384, torch.float32), (200, 1000, torch.bfloat16)])
def test_prefill_mixes_and_squares_in_one_pass(device, t, k, dtype, monkeypatch):
    """Past `MAX_PARTIAL_TOKENS` tokens the mixes and the sums of squares come from `mixes_kernel`
    (bf16 stream: fn as three bf16 pieces; float32: tf32x3) in K splits, against the float32 GEMM."""
    from hybridkv.ops.mhc import triton as kernels
    monkeypatch.setattr(kernels, "MIXES_SPLIT", 512)
    assert t > kernels.MAX_PARTIAL_TOKENS
    g = torch.Generator().manual_seed(6)
    x2 = (torch.randn(t, k, generator=g) * 2).to(dtype)
    fn = torch.randn(24, k, generator=g) * 0.05
    part = kernels.mix_partials(x2.to(device), fn.to(device))
    assert part.dtype == torch.float32 and part.shape[0] == t and part.shape[1] == -(-k // 512)
    mix, ss = kernels.raw_mixes(x2.to(device), fn.to(device))
    assert mix.shape == (t, 24) and ss.shape == (t,)
    ref = x2.double() @ fn.double().T
    assert rel_rms(ref.float(), mix.cpu()) <= 1e-5      # (H200, bf16 pieces: 1.8e-6; tf32 alone: ~1e-3)
    assert rel_rms(x2.double().square().sum(-1).float(), ss.cpu()) <= 1e-6
    # a token's sums do not depend on the launch's other tokens
    assert torch.equal(kernels.mix_partials(x2[:65].to(device), fn.to(device))[3, :, :25], part[3, :, :25])


def test_bf16_pieces_sum_to_fn():
    from hybridkv.ops.mhc import triton as kernels
    fn = torch.randn(24, 300, generator=torch.Generator().manual_seed(7)) * 0.05
    pieces = kernels.bf16_pieces(fn, 32)
    assert pieces.shape == (3, 32, 300) and not pieces[:, 24:].any()
    total = pieces.double().sum(0)[:24]
    assert ((total - fn.double()).abs() <= fn.double().abs() * 2.0**-23).all()


def test_a_tokens_mix_partials_do_not_depend_on_the_batch(device):
    """One token alone (a program per token) and in a batch of 40 (eight tokens a program): the
    same partial sums, bit for bit."""
    from hybridkv.ops.mhc import triton as kernels
    x, fn, *_ = _inputs(40, 4, 200, seed=4)
    x2, fn = x.flatten(1).to(device), fn.to(device)
    assert 40 > kernels.MIX_ONE_TOKEN
    m = fn.shape[0] + 1                    # the mixes and the sum of squares (the rest is padding)
    many = kernels.mix_partials(x2, fn)[..., :m]
    assert torch.equal(kernels.mix_partials(x2[13:14], fn)[..., :m], many[13:14])


@pytest.mark.parametrize("t,dim,dtype", [(3, 96, torch.float32), (2, 1000, torch.bfloat16), (11, 1000, torch.bfloat16)])
def test_v41_site_collapses_with_the_previous_mix(device, t, dim, dtype):
    """V4.1's single-pass site (`hc_mixes_collapse` on the kernels' path): the stream collapsed with
    the previous sub-block's pre mix, and this site's own pre, post and comb, against `hc_collapse`
    and `hc_mixes` (the reference mixes and Sinkhorn)."""
    from hybridkv.model.mhc import hc_collapse
    from hybridkv.ops.mhc import triton as kernels
    from hybridkv.ops.sinkhorn.reference import hc_split_sinkhorn
    hc = 4
    x, fn, scale, base, _ = _inputs(t, hc, dim, seed=3)
    x = x.to(dtype)
    prev = torch.rand(t, hc, generator=torch.Generator().manual_seed(4)) + 0.1
    flat = x.flatten(1).double()
    mixes = (flat @ fn.double().T * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)).float()
    pre_ref, post_ref, comb_ref = hc_split_sinkhorn(mixes, scale, base, hc, 20, 1e-6)
    y_ref = hc_collapse(x.float(), prev)
    dv = lambda a: a.to(device)  # noqa: E731
    y, pre, post, comb = kernels.mhc_mixes_collapse(dv(x), dv(prev), dv(fn), dv(scale), dv(base), 20, 1e-6, 1e-6)
    assert y.dtype == dtype
    assert rel_rms(y_ref, y.cpu().float()) <= (1e-6 if dtype == torch.float32 else 4e-3)   # y rounded to bf16
    for want, got in ((pre_ref, pre), (post_ref, post), (comb_ref, comb)):
        assert rel_rms(want, got.cpu()) <= 1e-4


@pytest.mark.parametrize("t,dim", [(3, 96), (2, 1000)])
def test_post_over_its_residual_writes_what_a_new_output_holds(device, t, dim):
    """The post written over the residual (a stream the caller reads no more) holds the bits of the
    post into a new tensor, whether a token's row is one program or split into column chunks; and
    `ops.mhc.mhc_post` leaves a residual that autograd needs untouched."""
    from hybridkv.ops import mhc
    from hybridkv.ops.mhc import triton as kernels
    hc = 4
    x, fn, scale, base, f = [a.to(device) for a in _inputs(t, hc, dim, seed=2)]
    _, post, comb = kernels.mhc_pre(x, x.flatten(1) @ fn.T, scale, base, 20, 1e-6, 1e-6)
    fresh = kernels.mhc_post(f, x, post, comb)
    residual = x.clone()
    over = kernels.mhc_post(f, residual, post, comb, out=residual)
    assert over.data_ptr() == residual.data_ptr() and torch.equal(over, fresh)
    leaf = x.clone().requires_grad_()
    with torch.enable_grad():
        kept = mhc.mhc_post(f, leaf, post, comb, over_residual=True)
    assert kept.data_ptr() != leaf.data_ptr() and torch.equal(leaf.detach(), x)
