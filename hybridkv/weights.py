"""Checkpoints in the release format: HF-style directories with `config.json` and either
`model.safetensors` or shards listed in `model.safetensors.index.json`.

Tensor names are the model's own parameter paths, which are the release's names
(`layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.scale`, `hc_head_fn`, `mtp.0.e_proj.weight`,
...). Formats: FP8 e4m3 weights with e8m0 (or float32 power-of-two) block scales; routed experts as
packed E2M1 pairs in I8/U8 with e8m0 scales per 32; `tid2eid` as I64 or I32; everything else any
float dtype. Every tensor the model needs is checked for presence, shape and dtype before anything
is copied, and the error names the tensor, what was expected and what was found.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybridkv.config import ModelConfig
from hybridkv.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_FLOATS = {"F32", "BF16", "F16", "F64"}
# the model's dtype -> dtypes a checkpoint may store it as
_ACCEPTED = {
    torch.float8_e4m3fn: {"F8_E4M3"},
    torch.float8_e8m0fnu: {"F8_E8M0", "F32"},
    torch.int8: {"I8", "U8"},
    torch.int32: {"I32", "I64"},
}
_ST_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3",
             torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64"}


def _accepted(dtype: torch.dtype) -> set[str]:
    return _ACCEPTED.get(dtype, _FLOATS)


def _describe(dtype: torch.dtype) -> str:
    return "/".join(sorted(_accepted(dtype)))


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        files = {name: model_dir / f for name, f in weight_map.items()}
        for f in set(files.values()):
            if not f.exists():
                raise CheckpointError(f"{index} lists shard {f.name}, which does not exist in {model_dir}")
        return files
    single = model_dir / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


class _Reader:
    """Open safetensors files on demand; read shapes/dtypes without loading data."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self._stack = ExitStack()
        self._open: dict[Path, object] = {}
        self.bytes_read = 0

    def __enter__(self) -> "_Reader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _handle(self, name: str):
        path = self.files[name]
        if path not in self._open:
            try:
                self._open[path] = self._stack.enter_context(safe_open(path, "pt"))
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read {path}: {e}") from None
        return self._open[path]

    def meta(self, name: str) -> tuple[list[int], str]:
        s = self._handle(name).get_slice(name)
        return list(s.get_shape()), s.get_dtype()

    def tensor(self, name: str, slices: tuple[tuple[int, int, int], ...] = ()) -> torch.Tensor:
        """The tensor, or only its (dim, start, stop) ranges (a rank's shard: only those bytes are
        read); `bytes_read` counts what was read."""
        if not slices:
            t = self._handle(name).get_tensor(name)
        else:
            s = self._handle(name).get_slice(name)
            index = [slice(None)] * len(s.get_shape())
            for dim, start, stop in slices:
                index[dim] = slice(start, stop)
            t = s[tuple(index)]
        self.bytes_read += t.numel() * t.element_size()
        return t


def _convert(name: str, t: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target.dtype == torch.float8_e8m0fnu and t.dtype == torch.float32:
        mant, _ = torch.frexp(t)
        if not bool(((mant == 0.5) & (t > 0)).all()):
            raise CheckpointError(f"tensor {name}: float32 scales must be positive powers of two to load as e8m0")
        return t.to(torch.float8_e8m0fnu)
    if target.dtype == torch.int8:
        return t.view(torch.int8) if t.dtype != torch.int8 else t
    return t.to(target.dtype)


def narrowable_float_weights(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The float32 weights whose users multiply with float32 products whatever the weight's own
    dtype (`hybridkv.model.linear.widened_linear`): the head and the float32 `Linear`s (the
    compressors' projections). The release stores them in bf16. Name -> owning module."""
    from hybridkv.model.linear import Linear
    out = {}
    for name, mod in model.named_modules():
        if (isinstance(mod, Linear) and mod.fmt == "float" and mod.compute_dtype == torch.float32
                and mod.weight.dtype == torch.float32) or (name == "head" and isinstance(mod, torch.nn.Linear)):
            out[f"{name}.weight"] = mod
    return out


def _narrow_float_weights(model: torch.nn.Module, reader: "_Reader") -> list[str]:
    """Give each narrowable float32 weight that the checkpoint stores in bf16 (or fp16) that dtype,
    so it is read at half the bytes; the values, and what is computed from them, stay the same."""
    narrowed = []
    for name, mod in narrowable_float_weights(model).items():
        if name not in reader.files:
            continue
        stored = {"BF16": torch.bfloat16, "F16": torch.float16}.get(reader.meta(name)[1])
        if stored is not None:
            mod.weight = torch.nn.Parameter(torch.empty_like(mod.weight, dtype=stored), requires_grad=False)
            narrowed.append(name)
    return narrowed


def _whole_model_names(model: torch.nn.Module) -> set[str]:
    """The tensor names of the unsharded model of a shard's config (built on the meta device: no
    memory): what a checkpoint may hold beyond this rank's part."""
    with torch.device("meta"):
        return set(type(model)(model.config, dtype=model.dtype).state_dict())


def load_state(model: torch.nn.Module, model_dir: str | Path, narrow_float: bool = False) -> int:
    """Copy a checkpoint into `model`, after checking every tensor's presence, shape and dtype.
    `narrow_float` (inference): float32 weights stored in bf16 keep that dtype
    (`narrowable_float_weights`). A sharded model (`hybridkv.distributed.sharding`) reads only its
    slices, and its experts by their global index. Returns the bytes of tensor data read."""
    from hybridkv.distributed.sharding import checkpoint_slices
    files = checkpoint_files(Path(model_dir))
    with _Reader(files) as reader:
        if narrow_float:
            _narrow_float_weights(model, reader)
        stack = getattr(model, "stack_projections", None)
        if stack is not None:   # buffers shared by the weights one GEMM reads; filled by the copy below
            stack()
        expected = model.state_dict()
        where = checkpoint_slices(model)        # model name -> (checkpoint name, ranges held)
        sharded = any(sl or ckpt != name for name, (ckpt, sl) in where.items())
        missing = [where[n][0] for n in expected if where[n][0] not in files]
        known = _whole_model_names(model) if sharded else expected
        unexpected = [n for n in files if n not in known]
        problems = []
        if missing:
            problems.append(f"missing tensor(s): {_some(missing)}")
        if unexpected:
            problems.append(f"unexpected tensor(s) not used by this config: {_some(unexpected)}")
        for name, target in expected.items():
            ckpt, slices = where[name]
            if ckpt not in files:
                continue
            shape, st_dtype = reader.meta(ckpt)
            held = list(shape)
            for dim, start, stop in slices:
                held[dim] = stop - start if stop <= shape[dim] else -1
            want_shape = list(target.shape)
            if held != want_shape or st_dtype not in _accepted(target.dtype):
                what = f"expected shape {want_shape}" if not slices else \
                    f"expected a shape whose ranges {[(d, a, b) for d, a, b in slices]} give {want_shape}"
                problems.append(f"tensor {ckpt}: {what} dtype {_describe(target.dtype)}, "
                                f"found shape {shape} dtype {st_dtype}")
        if problems:
            raise CheckpointError(f"checkpoint {model_dir} does not match the model config:\n  " + "\n  ".join(problems))
        with torch.no_grad():
            for name, target in expected.items():
                ckpt, slices = where[name]
                target.copy_(_convert(ckpt, reader.tensor(ckpt, slices), target))
        return reader.bytes_read


def _some(names: list[str], k: int = 8) -> str:
    head = ", ".join(names[:k])
    return head + (f", ... ({len(names)} in all)" if len(names) > k else "")


def iter_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a checkpoint, in release dtypes (tid2eid as I64)."""
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if t.untyped_storage().nbytes() != t.nbytes:    # a view (stacked experts): its own bytes only
            t = t.clone()
        if name.endswith("tid2eid"):
            t = t.to(torch.int64)
        yield name, t.contiguous()


def save_checkpoint(model: torch.nn.Module, config: ModelConfig, model_dir: str | Path,
                    max_shard_bytes: int | None = None) -> None:
    """Write config.json and the weights (one file, or shards of at most max_shard_bytes + an index).
    Files are written under temporary names and renamed, so a crash leaves no half checkpoint."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in iter_state(model):
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}
    written: list[tuple[Path, Path]] = []
    if len(shards) == 1:
        written.append((model_dir / (SINGLE_FILE + ".tmp"), model_dir / SINGLE_FILE))
        save_file(shards[0], written[-1][0], metadata=meta)
        commit_checkpoint(model_dir, config, written)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            written.append((model_dir / (fname + ".tmp"), model_dir / fname))
            save_file(shard, written[-1][0], metadata=meta)
            weight_map.update({n: fname for n in shard})
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        commit_checkpoint(model_dir, config, written, weight_map, total)


def commit_checkpoint(model_dir: Path, config: ModelConfig, written: list[tuple[Path, Path]],
                      weight_map: dict[str, str] | None = None, total_size: int = 0) -> None:
    """Finish a checkpoint whose weight files are `written` as (temporary, final) paths: write the
    shard index (when `weight_map` is given) and config.json under temporary names, rename them all
    into place, and remove the other layout's file, so that a crash leaves no half checkpoint."""
    written = list(written)
    if weight_map is not None:
        idx_tmp = model_dir / (INDEX_FILE + ".tmp")
        idx_tmp.write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2))
        written.append((idx_tmp, model_dir / INDEX_FILE))
    cfg_tmp = model_dir / "config.json.tmp"
    cfg_tmp.write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    written.append((cfg_tmp, model_dir / "config.json"))
    for tmp, final in written:
        tmp.replace(final)
    stale = model_dir / (SINGLE_FILE if weight_map is not None else INDEX_FILE)
    if stale.exists():
        stale.unlink()


def checkpoint_identity(model_dir: str | Path) -> str:
    """A content fingerprint of a checkpoint (config, tensor table, and samples of every file's
    bytes) that names the model in prefix-cache keys: caches never mix models."""
    import hashlib

    model_dir = Path(model_dir)
    h = hashlib.sha256()
    h.update(json.dumps(json.loads((model_dir / "config.json").read_text()), sort_keys=True).encode())
    for f in sorted(set(checkpoint_files(model_dir).values())):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            h.update(f.name.encode() + size.to_bytes(8, "little"))
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.hexdigest()[:32]


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               parallel=None):
    """(Transformer, ModelConfig) from a model directory; with `parallel` (a
    `hybridkv.distributed.Parallel`), this rank's shard, read from its slices only
    (`model.bytes_loaded` says how many bytes were read)."""
    from hybridkv.distributed.group import SINGLE
    from hybridkv.model import Transformer

    config = ModelConfig.from_json(Path(model_dir))
    dtype = dtype or torch.float32
    with torch.device(device):
        model = Transformer(config, dtype=dtype, parallel=parallel or SINGLE)
    # a half-precision model is for inference: the release's bf16 float weights stay bf16
    model.bytes_loaded = load_state(model, model_dir, narrow_float=dtype in (torch.bfloat16, torch.float16))
    model.compacted_fp8 = compact_exact_fp8_weights(model)
    return model.eval(), config


def compact_exact_fp8_weights(model) -> int:
    """On CUDA, each attention's `wo_a` whose bf16 values are FP8 (the release's, widened by its
    conversion) goes back to e4m3 with its block scales (`Linear.compact_exact_fp8`): half the bytes
    in memory and in every step, the same numbers. Off with `HYBRIDKV_DENSE_WEIGHTS=1` or
    `HYBRIDKV_FP8_EXACT=0` (a benchmark baseline). Returns how many were."""
    import os

    from hybridkv.model.attention import Attention
    from hybridkv.ops.backend import dense_weights
    if dense_weights() or os.environ.get("HYBRIDKV_FP8_EXACT", "1") == "0":
        return 0
    return sum(m.wo_a.compact_exact_fp8() for m in model.modules()
               if isinstance(m, Attention) and m.wo_a.weight.is_cuda)
