"""Model configuration: `ModelConfig`, read from an HF-style `config.json` with the field names of
the DeepSeek-V4 / V4.1 releases, validated on construction (the named presets are `presets.py`'s).

A config is data. Everything the model, the weight loader and the KV accounting need to know
about an architecture is a field or a property derived from fields here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.errors import ConfigError

SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
KV_FP8_BLOCK = 64  # the window/compressed KV nope dims are FP8-simulated in blocks of 64
FP4_BLOCK = 32
# DeepSeek-V4.1 storage round trips: window KV FP8 over all dims, global KV FP4 with e4m3 scales
V41_WINDOW_FP8_BLOCK = 32
V41_GLOBAL_FP4_BLOCK = 16
V4_TYPES = ("deepseek_v4",)
V41_TYPES = ("deepseek_v41", "deepseek_v4_1")
MLA_TYPES = ("deepseek_v32",)
CSA_RATIO = 4  # V4: the compressing layers of this ratio are CSA (overlapping blocks, Lightning Indexer); others HCA


@dataclass(frozen=True)
class RopeScaling:
    """YaRN frequency interpolation (no attention-scale correction, as in the V4 reference)."""

    type: str = "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32
    beta_slow: float = 1


# A model whose linears are float and whose routed experts are FP4 (or FP8) has no
# quantization_config of its own (quantization_config None, expert_dtype "fp4"). Its config.json
# carries one all the same, the release's plus these modules to leave unconverted (transformers'
# module names: everything but the routed experts), because that is how transformers' DeepSeek-V4
# loader learns that the experts are packed; without it, it sizes them as bf16 and re-initialises
# them. Read back, such a quantization_config means quantization_config None.
EXPERTS_ONLY_UNCONVERTED = ("lm_head", "model.embed_tokens", "model.layers.*.self_attn", "model.layers.*.mlp.gate",
                            "model.layers.*.mlp.shared_experts")


@dataclass(frozen=True)
class QuantizationConfig:
    """FP8 block quantisation of the linears (`quantization_config` in the release)."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    scale_fmt: str | None = "ue8m0"
    weight_block_size: tuple[int, int] = (128, 128)


@dataclass(frozen=True)
class ModelConfig:
    # identity
    model_type: str = "deepseek_v4"
    architectures: tuple[str, ...] = ("DeepseekV4ForCausalLM",)
    # shape
    vocab_size: int = 512
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_nextn_predict_layers: int = 0
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 96
    qk_rope_head_dim: int = 32
    q_lora_rank: int = 64
    o_groups: int = 2
    o_lora_rank: int = 32
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = (0, 0)
    # rope
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    # lightning indexer
    index_n_heads: int = 16
    index_head_dim: int = 64
    index_topk: int = 16
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # MoE
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    num_hash_layers: int = 0
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.0
    gate_temp: float = 1.0  # V4.1: gate logits are divided by it before scoring
    norm_topk_prob: bool = True
    topk_method: str = "noaux_tc"
    swiglu_limit: float = 0.0
    # misc
    rms_norm_eps: float = 1e-6
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    quantization_config: QuantizationConfig | None = None
    expert_dtype: str | None = None
    # DeepSeek-V4.1 (CSA2 sharing, hierarchical indexer)
    kv_source_layer_ids: tuple[int, ...] | None = None
    index_source_layer_ids: tuple[int, ...] | None = None
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int | None = None
    candidate_block_size: int | None = None
    # MLA (DeepSeek-V3.2; accounting only)
    kv_lora_rank: int | None = None
    # fields of config.json this class does not model, kept so a round trip loses nothing
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        _validate(self)

    # ----- derived -----
    @property
    def family(self) -> str:
        if self.model_type in MLA_TYPES:
            return "v3.2"
        if self.model_type in V41_TYPES or self.kv_source_layer_ids is not None:
            return "v4.1"
        return "v4"

    @property
    def multimodal(self) -> bool:
        """A V4.1 release config with a vision tower (`vision_config`); hybridkv runs the text path,
        but the checkpoint then carries the image tokens' gate bias (`ffn.gate.bias_vl`)."""
        vc = self.extra.get("vision_config")
        return isinstance(vc, dict) and vc.get("num_hidden_layers", 1) > 0

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def num_layers_with_mtp(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def layer_ratio(self, layer_id: int) -> int:
        """Compression ratio of a backbone layer (ids >= num_hidden_layers are MTP layers)."""
        return self.compress_ratios[layer_id]

    def layer_kind(self, layer_id: int) -> str:
        """V4: 'swa' (window only), 'csa' (ratio CSA_RATIO, with the Lightning Indexer) or 'hca'.
        V4.1: 'swa' or the CSA2 mode of a compressed layer:
        'full' (own compressor, indexer keys and top-k), 'reindex' (own top-k over the last Full
        layer's keys) or 'reuse' (the last Full layer's KV and the last indexer's top-k)."""
        r = self.layer_ratio(layer_id)
        if r == 0:
            return "swa"
        if self.family == "v4.1":
            if layer_id in self.kv_source_layer_ids:
                return "full"
            return "reindex" if layer_id in self.index_source_layer_ids else "reuse"
        return "csa" if r == CSA_RATIO else "hca"

    def kv_source(self, layer_id: int) -> int | None:
        """The layer whose compressed KV (and, in V4.1, indexer keys) this layer attends over:
        itself in V4; in V4.1 the last Full layer at or before it. None for window-only layers."""
        if self.layer_ratio(layer_id) == 0:
            return None
        if self.family != "v4.1":
            return layer_id
        return max((i for i in self.kv_source_layer_ids if i <= layer_id), default=None)

    def index_source(self, layer_id: int) -> int | None:
        """V4.1: the last Full or Reindex layer at or before this one, whose top-k it uses."""
        if self.layer_ratio(layer_id) == 0 or self.family != "v4.1":
            return None
        return max((i for i in self.index_source_layer_ids if i <= layer_id), default=None)

    def uses_candidates(self, layer_id: int) -> bool:
        """V4.1: whether this indexer takes its top-k inside the candidate source's pool."""
        cs = self.candidate_source_layer_id
        return (self.family == "v4.1" and cs is not None and cs < layer_id
                and layer_id in self.index_source_layer_ids)

    @property
    def block_tokens(self) -> int:
        """Native tokens per logical KV block: the lcm of the compression ratios and 128 (128 for V4
        and V4.1), so that a block holds whole entries of every layer and prefix-cache blocks stay
        128 tokens when the ratios are small (V4.1's 1 and 2)."""
        ratios = [r for r in self.compress_ratios if r > 0]
        return math.lcm(*ratios, 128) if ratios else self.sliding_window

    @property
    def quantized(self) -> bool:
        return self.quantization_config is not None

    @property
    def fp8_block(self) -> tuple[int, int]:
        return tuple(self.quantization_config.weight_block_size) if self.quantization_config else (128, 128)

    @property
    def kv_pow2_scales(self) -> bool:
        """Whether the KV FP8 round trips use power-of-two scales. The reference takes this from
        the checkpoint's scale_fmt (ue8m0 in the releases); a model without a quantization_config
        uses plain amax/448 scales, as the reference does with scale_fmt None. The V4.1 reference
        fixes ue8m0 whatever the checkpoint says."""
        if self.family == "v4.1":
            return True
        qc = self.quantization_config
        return qc is not None and qc.scale_fmt == "ue8m0"

    @property
    def activation_block(self) -> int:
        """Activations are quantised in blocks of the weight block's input size before FP8 GEMMs."""
        return self.fp8_block[1]

    # ----- I/O -----
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        text = d.get("text_config")
        if isinstance(text, dict) and "compress_ratios" not in d:
            # a multimodal release nests the language model's fields under text_config
            d.pop("text_config")
            d = {**d, **{k: v for k, v in text.items() if k != "model_type"}}
        if isinstance(d.get("candidate_source_layer_id"), int) and d["candidate_source_layer_id"] < 0:
            d["candidate_source_layer_id"] = None  # the reference's "no candidate pool"
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        for k in list(d):
            if k in known:
                kwargs[k] = d.pop(k)
        rs = kwargs.get("rope_scaling")
        if isinstance(rs, dict):
            rs = dict(rs)
            rs.setdefault("type", rs.pop("rope_type", "yarn"))
            unknown = set(rs) - {f.name for f in dataclasses.fields(RopeScaling)}
            for k in unknown:
                rs.pop(k)
            kwargs["rope_scaling"] = RopeScaling(**rs)
        qc = kwargs.get("quantization_config")
        if isinstance(qc, dict) and qc.get("expert_dtype") is not None:   # where V4.1 releases keep it
            if kwargs.get("expert_dtype") not in (None, qc["expert_dtype"]):
                raise ConfigError(f"expert_dtype {kwargs['expert_dtype']!r} and quantization_config.expert_dtype "
                                  f"{qc['expert_dtype']!r} disagree")
            kwargs["expert_dtype"] = qc["expert_dtype"]
        if isinstance(qc, dict) and qc.get("modules_to_not_convert"):
            _check_experts_only(qc, kwargs.get("expert_dtype"))
            kwargs["quantization_config"] = qc = None
        if isinstance(qc, dict):
            qc = {k: v for k, v in qc.items() if k in {f.name for f in dataclasses.fields(QuantizationConfig)}}
            if "weight_block_size" in qc:
                qc["weight_block_size"] = tuple(qc["weight_block_size"])
            kwargs["quantization_config"] = QuantizationConfig(**qc)
        for k in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "architectures"):
            if kwargs.get(k) is not None:
                kwargs[k] = tuple(kwargs[k])
        if "compress_ratios" not in kwargs and kwargs.get("model_type") not in MLA_TYPES:
            raise ConfigError("config.json has no 'compress_ratios': one entry per layer plus one per MTP layer is required")
        d.pop("extra", None)
        kwargs["extra"] = d
        try:
            return cls(**kwargs)
        except TypeError as e:  # wrong field types reach here
            raise ConfigError(f"invalid config: {e}") from e

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            if v is None and f.name in ("kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
                                        "candidate_topk_blocks", "candidate_block_size", "kv_lora_rank",
                                        "expert_dtype", "rope_scaling"):
                continue
            if f.name == "quantization_config" and v is None:
                if self.expert_dtype not in ("fp4", "fp8"):
                    continue
                v = _experts_only(self.expert_dtype)
            elif dataclasses.is_dataclass(v):
                v = dataclasses.asdict(v)
                if "weight_block_size" in v:
                    v["weight_block_size"] = list(v["weight_block_size"])
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _experts_only(expert_dtype: str) -> dict[str, Any]:
    """The quantization_config written for float linears and `expert_dtype` routed experts."""
    qc = dataclasses.asdict(QuantizationConfig())
    qc["weight_block_size"] = list(qc["weight_block_size"])
    return {**qc, "expert_dtype": expert_dtype, "modules_to_not_convert": list(EXPERTS_ONLY_UNCONVERTED)}


def _check_experts_only(qc: dict[str, Any], expert_dtype: str | None) -> None:
    """A quantization_config with modules_to_not_convert must be the one `_experts_only` writes."""
    skip = qc["modules_to_not_convert"]
    if not isinstance(skip, list) or set(skip) != set(EXPERTS_ONLY_UNCONVERTED):
        raise ConfigError(f"quantization_config.modules_to_not_convert {skip}: hybridkv quantises every linear "
                          f"(no list) or only the routed experts (the list {list(EXPERTS_ONLY_UNCONVERTED)})")
    if expert_dtype not in ("fp4", "fp8"):
        raise ConfigError(f"quantization_config with modules_to_not_convert quantises only the routed experts, "
                          f"but expert_dtype is {expert_dtype!r} (not 'fp4' or 'fp8')")
    want = _experts_only(expert_dtype)
    for k in ("quant_method", "fmt", "scale_fmt", "weight_block_size"):
        if k in qc and qc[k] != want[k]:
            raise ConfigError(f"quantization_config.{k} {qc[k]!r}: a model with float linears and quantised experts "
                              f"has {want[k]!r}")


def _fail(msg: str) -> None:
    raise ConfigError(msg)


def _validate(c: ModelConfig) -> None:
    def positive(name: str) -> None:
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            _fail(f"{name} must be a positive integer, got {v!r}")

    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"):
        positive(name)
    if c.model_type in MLA_TYPES:
        if not c.kv_lora_rank:
            _fail("a DeepSeek-V3.2 (MLA) config needs kv_lora_rank")
        return
    for name in ("head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                 "hc_mult", "hc_sinkhorn_iters", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
        positive(name)
    if c.num_nextn_predict_layers < 0 or c.num_hash_layers < 0:
        _fail("num_nextn_predict_layers and num_hash_layers must be >= 0")
    n_expected = c.num_hidden_layers + c.num_nextn_predict_layers
    if len(c.compress_ratios) != n_expected:
        _fail(f"compress_ratios has {len(c.compress_ratios)} entries but num_hidden_layers "
              f"({c.num_hidden_layers}) + num_nextn_predict_layers ({c.num_nextn_predict_layers}) = {n_expected}: "
              f"give one ratio per layer plus one per MTP layer")
    if any((not isinstance(r, int)) or r < 0 for r in c.compress_ratios):
        _fail(f"compress_ratios must be non-negative integers, got {list(c.compress_ratios)}")
    if c.num_key_value_heads != 1:
        _fail(f"num_key_value_heads must be 1 (DeepSeek-V4 attention is MQA over one shared latent), got {c.num_key_value_heads}")
    if c.qk_rope_head_dim % 2 or c.qk_rope_head_dim > c.head_dim:
        _fail(f"qk_rope_head_dim ({c.qk_rope_head_dim}) must be even and at most head_dim ({c.head_dim})")
    if c.family == "v4" and c.nope_head_dim % KV_FP8_BLOCK:
        _fail(f"head_dim - qk_rope_head_dim = {c.nope_head_dim} is not a multiple of the FP8 KV block "
              f"({KV_FP8_BLOCK}): the window and compressed KV nope dims are quantised in blocks of {KV_FP8_BLOCK}")
    if c.num_attention_heads % c.o_groups:
        _fail(f"num_attention_heads ({c.num_attention_heads}) must be divisible by o_groups ({c.o_groups})")
    if c.num_experts_per_tok > c.n_routed_experts:
        _fail(f"num_experts_per_tok ({c.num_experts_per_tok}) exceeds n_routed_experts ({c.n_routed_experts})")
    if c.n_shared_experts != 1:
        _fail(f"n_shared_experts must be 1 (as in every V4 release), got {c.n_shared_experts}")
    if c.scoring_func not in SCORING_FUNCS:
        _fail(f"scoring_func must be one of {SCORING_FUNCS}, got {c.scoring_func!r}")
    if c.num_hash_layers > c.num_hidden_layers:
        _fail(f"num_hash_layers ({c.num_hash_layers}) exceeds num_hidden_layers ({c.num_hidden_layers})")
    if c.rope_scaling is not None and c.rope_scaling.type != "yarn":
        _fail(f"rope_scaling.type {c.rope_scaling.type!r} is not supported (only 'yarn')")
    if c.expert_dtype not in (None, "fp4", "fp8", "bf16"):
        _fail(f"expert_dtype must be 'fp4', 'fp8', 'bf16' or absent, got {c.expert_dtype!r}")
    if c.quantization_config is not None:
        qc = c.quantization_config
        if qc.quant_method != "fp8" or qc.fmt != "e4m3":
            _fail(f"quantization_config: only fp8 e4m3 is supported, got {qc.quant_method}/{qc.fmt}")
        if len(qc.weight_block_size) != 2 or min(qc.weight_block_size) <= 0:
            _fail(f"quantization_config.weight_block_size must be two positive ints, got {qc.weight_block_size}")
    if any(r > 0 for r in c.compress_ratios) or c.family == "v4.1":
        if c.family == "v4" and (c.index_head_dim % FP4_BLOCK or c.index_head_dim & (c.index_head_dim - 1)):
            _fail(f"index_head_dim ({c.index_head_dim}) must be a power of two and a multiple of {FP4_BLOCK} "
                  f"(Hadamard rotation and FP4 blocks)")
        if c.index_head_dim % FP4_BLOCK:
            _fail(f"index_head_dim ({c.index_head_dim}) must be a multiple of {FP4_BLOCK} (FP4 indexer key blocks)")
        if c.index_head_dim < c.qk_rope_head_dim:
            _fail(f"index_head_dim ({c.index_head_dim}) must be at least qk_rope_head_dim ({c.qk_rope_head_dim})")
        positive("index_n_heads")
        positive("index_topk")
    if c.family == "v4.1":
        _validate_v41(c)


def _validate_v41(c: ModelConfig) -> None:
    n = c.num_hidden_layers
    backbone = c.compress_ratios[:n]
    if c.head_dim % V41_WINDOW_FP8_BLOCK:
        _fail(f"head_dim ({c.head_dim}) must be a multiple of {V41_WINDOW_FP8_BLOCK}: V4.1 window KV is FP8 in blocks "
              f"of {V41_WINDOW_FP8_BLOCK} and global KV FP4 in blocks of {V41_GLOBAL_FP4_BLOCK}")
    if c.num_hash_layers:
        _fail(f"num_hash_layers must be 0 for DeepSeek-V4.1 (it routes every layer by score), got {c.num_hash_layers}")
    if c.gate_temp <= 0:
        _fail(f"gate_temp must be positive, got {c.gate_temp}")
    if any(r > 0 for r in c.compress_ratios[n:]):
        _fail(f"the draft (MTP) layers of a V4.1 config must not compress (ratio 0), got {list(c.compress_ratios[n:])}")
    for name in ("kv_source_layer_ids", "index_source_layer_ids"):
        ids = getattr(c, name)
        if ids is None:
            _fail(f"a V4.1 config needs {name}")
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < n:
                _fail(f"{name} names layer {i}, outside 0..{n - 1}")
            if backbone[i] == 0:
                _fail(f"{name} names layer {i}, which does not compress (ratio 0)")
        if list(ids) != sorted(set(ids)):
            _fail(f"{name} must be strictly increasing, got {list(ids)}")
    if not set(c.kv_source_layer_ids) <= set(c.index_source_layer_ids):
        missing = sorted(set(c.kv_source_layer_ids) - set(c.index_source_layer_ids))
        _fail(f"kv source layer(s) {missing} must also be in index_source_layer_ids: a Full layer computes its "
              f"own top-k")
    first_src = c.kv_source_layer_ids[0] if c.kv_source_layer_ids else None
    for i, r in enumerate(backbone):
        if r == 0:
            continue
        if first_src is None or i < first_src:
            _fail(f"layer {i} compresses (ratio {r}) before the first kv source layer "
                  f"{first_src}: it would have no compressed KV to read; add it to kv_source_layer_ids")
        src = c.kv_source(i)
        if backbone[src] != r:
            _fail(f"layer {i} (ratio {r}) reads the compressed KV of layer {src} (ratio {backbone[src]}): a layer "
                  f"sharing KV must have its source's ratio; make layer {i} a kv source or change its ratio")
    cs = c.candidate_source_layer_id
    if cs is None:
        return
    if cs not in c.kv_source_layer_ids:
        _fail(f"candidate_source_layer_id {cs} must be one of kv_source_layer_ids {list(c.kv_source_layer_ids)}")
    for i in c.index_source_layer_ids:
        if i not in c.kv_source_layer_ids and i < cs:
            _fail(f"Reindex layer {i} comes before the candidate source layer {cs}: it would have no candidate pool")
        if i > cs and backbone[i] != backbone[cs]:
            _fail(f"index source layer {i} (ratio {backbone[i]}) takes its top-k inside the candidate pool of layer "
                  f"{cs} (ratio {backbone[cs]}): both must have the same ratio")
    for name in ("candidate_topk_blocks", "candidate_block_size"):
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            _fail(f"candidate_source_layer_id needs {name} as a positive integer, got {v!r}")
    # the pool holds at least (blocks - 1) full blocks plus the newest position; a smaller pool than
    # index_topk would make Reindex layers pick positions outside it
    pool = (c.candidate_topk_blocks - 1) * c.candidate_block_size + 1
    if pool < c.index_topk:
        _fail(f"the candidate pool ({c.candidate_topk_blocks} blocks x {c.candidate_block_size}) can hold as few as "
              f"{pool} positions, fewer than index_topk ({c.index_topk}); raise candidate_topk_blocks")

