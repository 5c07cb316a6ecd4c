"""Compile the attention-path kernels for sm_90 on a machine without a GPU and print their resources:
registers, spilled bytes (stack), shared memory, the kind of MMA instruction (HGMMA = wgmma,
HMMA = mma.sync) and the SASS instruction count of the hottest loop. This answers, before any
device time, whether a launch shape spills and how heavy its inner loop is.

Triton's own compiler and the ptxas/cuobjdump bundled with the triton wheel do the work; the
launchers run unchanged at V4-Flash shapes (CPU tensors, a stand-in driver that reports an H200),
and each kernel is compiled instead of launched.

    python benchmarks/kernel_resources.py [--sms 132]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.backends.nvidia.compiler as nv_compiler  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

H, D, ROPE, HI, DI, TOPK, W = 64, 512, 64, 64, 128, 512, 128
CUOBJDUMP = os.path.join(os.path.dirname(nv_compiler.__file__), "bin", "cuobjdump")


class _H200:
    """Just enough of a driver for Triton to compile for sm_90 (nothing is launched)."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


_compiled: list = []


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _RUN(self, *args, grid=grid, warmup=True, **kwargs)
    _compiled.append((self.fn.__name__, kernel, grid))
    return kernel


_RUN = JITFunction.run


def resources(kernel) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(kernel.asm["cubin"])
        fh.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", fh.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "--dump-sass", fh.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    ops = {}
    for line in sass.splitlines():
        mm = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if mm:
            ops[int(mm.group(1), 16)] = mm.group(2)
    loop, kinds = 0, collections.Counter()
    for addr, text in ops.items():
        b = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if b and int(b.group(1), 16) < addr:          # a backward branch closes a loop
            body = [ops[a] for a in ops if int(b.group(1), 16) <= a <= addr]
            loop = max(loop, len(body))
    for text in ops.values():
        op = re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", text).group(1)
        kinds[op] += 1
    mma = "HGMMA" if kinds["HGMMA"] else ("HMMA" if kinds["HMMA"] else "—")
    return dict(regs=int(m.group(1)), stack=int(m.group(2)), smem=kernel.metadata.shared, mma=mma, loop=loop)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sms", type=int, default=132, help="multiprocessors the launch shapes are chosen for")
    args = ap.parse_args()
    driver.set_active(_H200())
    JITFunction.run = _compile_only
    from hybridkv.ops.indexer_topk import triton as idx_k
    from hybridkv.ops.paged import PagedBatch
    from hybridkv.ops.sparse_attn import triton as attn_k
    idx_k._sms = attn_k._sms = lambda device: args.sms
    rows = []

    def collect(case):
        for name, kernel, grid in _compiled:
            rows.append(dict(case=case, kernel=name, grid=tuple(grid), **resources(kernel)))
        _compiled.clear()

    ctx = 1 << 20
    blocks = ctx // 128 + 1
    for b in (1, 8):
        batch = PagedBatch.build([(r, ctx - 1, 1, list(range(r * blocks, (r + 1) * blocks))) for r in range(b)], 128)
        idx_k.indexer_topk_paged(torch.zeros(b, HI, DI).bfloat16(), torch.zeros(b, HI), batch,
                                 torch.zeros(4, 32, 68, dtype=torch.uint8), TOPK, 4, "fp4", DI, max_visible=ctx // 4)
        collect(f"decode 1M B={b}: indexer fp4")
        for fmt in ("fp8", "bf16"):
            e = (lambda *s: torch.zeros(*s, 584, dtype=torch.uint8)) if fmt == "fp8" else \
                (lambda *s: torch.zeros(*s, D).bfloat16())
            q, sink = torch.zeros(b, H, D).bfloat16(), torch.zeros(H)
            idx = torch.zeros(b, TOPK, dtype=torch.int32)
            attn_k.sparse_attn_paged(q, sink, 0.04, batch, e(b), e(b, W), e(4, 32), idx, 4, fmt, D, ROPE, W)
            collect(f"decode 1M B={b}: CSA attention {fmt}")
            attn_k.sparse_attn_paged(q, sink, 0.04, batch, e(b), e(b, W), e(4, 1), None, 128, fmt, D, ROPE, W,
                                     max_pos=ctx - 1)
            collect(f"decode 1M B={b}: HCA attention {fmt}")
    t, ctx = 2048, 131072
    batch = PagedBatch.build([(0, ctx - t, t, list(range(ctx // 128 + 1)))], 128)
    idx_k.indexer_topk_paged(torch.zeros(t, HI, DI).bfloat16(), torch.zeros(t, HI), batch,
                             torch.zeros(4, 32, 68, dtype=torch.uint8), TOPK, 4, "fp4", DI, max_visible=ctx // 4)
    collect(f"prefill {t} tokens at 128K: indexer fp4")
    for fmt in ("fp8", "bf16"):
        e = (lambda *s: torch.zeros(*s, 584, dtype=torch.uint8)) if fmt == "fp8" else \
            (lambda *s: torch.zeros(*s, D).bfloat16())
        q, sink = torch.zeros(t, H, D).bfloat16(), torch.zeros(H)
        attn_k.sparse_attn_paged(q, sink, 0.04, batch, e(t), e(1, W), e(4, 32), torch.zeros(t, TOPK, dtype=torch.int32),
                                 4, fmt, D, ROPE, W)
        collect(f"prefill {t} tokens at 128K: CSA attention {fmt}")
    seen = set()
    print(f"sm_90 · triton {triton.__version__} · launch shapes for {args.sms} SMs\n")
    print("| case | kernel | grid | registers | spill (B) | smem (B) | MMA | loop SASS |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        key = (r["case"], r["kernel"], r["grid"])
        if key in seen:
            continue
        seen.add(key)
        print(f"| {r['case']} | {r['kernel']} | {r['grid']} | {r['regs']} | {r['stack']} | {r['smem']} | {r['mma']} | "
              f"{r['loop']} |")


if __name__ == "__main__":
    main()
