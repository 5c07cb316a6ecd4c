"""FP8 linears through torch's block-scaled matmul (`torch.nn.functional.scaled_mm` with 1×128
activation and 128×128 weight scales, cuBLASLt's FP8 tensor-core path on Hopper), for inputs of
many rows (prefill). The activations are quantised to e4m3 codes with power-of-two scales per 128
values by one Triton launch (`act_codes`), with the rounding of `act_quant_sim`; the product of codes and scales
is then the reference's GEMM of the round-tripped input and the dequantised weight, up to the
order of the fp32 accumulation.

Which scale layout cuBLASLt reads has changed between torch releases, so the first call on a
device checks each candidate layout against the reference on a random problem and keeps the one
that agrees (`layout`); if none does, or this torch has no blockwise scaled matmul, `layout` says
why and the callers keep the Triton kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.ops.qgemm.triton import act_codes

BLOCK = 128
ROW_PAD = 4          # cuBLASLt wants the activation scales' rows padded to a multiple of 4
_LAYOUTS: dict[int, tuple[str | None, str]] = {}     # device index -> (layout or None, why)


def _recipes():
    st = getattr(F, "ScalingType", None)
    name = next((n for n in ("BlockWise1x128", "Blockwise_1x128") if st is not None and hasattr(st, n)), None)
    if not hasattr(F, "scaled_mm") or name is None:
        return None
    return getattr(st, name), getattr(st, name.replace("1x128", "128x128"))


def _run(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
         layout: str) -> torch.Tensor:
    r_act, r_w = _recipes()
    outer = layout == "outer-major"
    q, s = act_codes(x2, ROW_PAD, outer)
    w_scale = scale.float()
    w_scale = w_scale.t() if outer else w_scale
    y = F.scaled_mm(q, weight.t(), s, r_act, w_scale, r_w, output_dtype=out_dtype)
    return y[: x2.shape[0]]


def layout(device: torch.device) -> tuple[str | None, str]:
    """(the scale layout this torch's blockwise scaled matmul reads correctly on `device`, or None;
    what was found). Checked once per device against the reference GEMM."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in _LAYOUTS:
        return _LAYOUTS[idx]
    from hybridkv.ops.qgemm import reference
    from hybridkv.ops.quant import quant_fp8_weight
    if _recipes() is None:
        _LAYOUTS[idx] = (None, f"torch {torch.__version__} has no blockwise scaled_mm")
        return _LAYOUTS[idx]
    g = torch.Generator(device=device).manual_seed(0)
    n, k, m = 384, 512, 200
    w = torch.randn(n, k, device=device, generator=g) * torch.logspace(-2, 0, n // 128, device=device).repeat_interleave(128)[:, None]
    wq, ws = quant_fp8_weight(w)
    x = (torch.randn(m, k, device=device, generator=g) * torch.logspace(-2, 1, k // 128, device=device)
         .repeat_interleave(128)).to(torch.bfloat16)
    want = reference.fp8_linear(x.float(), wq, ws, (BLOCK, BLOCK), torch.float32)
    found = []
    for name in ("outer-major", "row-major"):
        try:
            got = _run(x, wq, ws, torch.float32, name)
        except Exception as e:  # what this torch refuses is the finding
            found.append(f"{name}: {str(e).splitlines()[0][:120]}")
            continue
        err = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
        if err < 2e-3:       # the FP8 MMA's reduced-precision accumulation: ~1e-4; a wrong layout: > 1e-1
            _LAYOUTS[idx] = (name, f"{name} scales agree with the reference (rel rms {err:.1e})")
            return _LAYOUTS[idx]
        found.append(f"{name}: rel rms {err:.1e} against the reference")
    _LAYOUTS[idx] = (None, "; ".join(found))
    return _LAYOUTS[idx]


def fp8_linear(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
    """x [M, K] @ (e4m3 [N, K] × e8m0 per 128×128)ᵀ -> [M, N] of out_dtype, or None where this
    torch's scaled matmul cannot compute it (the caller runs the Triton kernel)."""
    lay, _ = layout(x2.device)
    # cuBLASLt wants the K/128 scale blocks in fours ("scale_b must have shape 4 x 1" for K = 256)
    if lay is None or out_dtype not in (torch.bfloat16, torch.float32) or weight.shape[0] % 16 or weight.shape[1] % 512:
        return None
    return _run(x2, weight, scale, out_dtype, lay)
