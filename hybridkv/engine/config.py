"""The options of an engine run: `EngineConfig` (validated on creation), its one command-line
definition (`EngineConfig.add_arguments` / `EngineConfig.from_args`, shared by `generate`, `serve`
and `eval`; the model options `--device` / `--dtype` also by `demo`), and the compute dtype that
`--dtype auto` means on a device.

Flags take vLLM's names where vLLM has the option (`--max-num-seqs`, `--max-model-len`,
`--max-num-batched-tokens`, `--enable-prefix-caching`, `--dtype`, `--enforce-eager`, and
`--kv-cache-dtype` / `--num-gpu-blocks-override` as second spellings of `--kv-format` /
`--num-blocks`); hybridkv-only options keep hybridkv's names. Spellings used before are still
accepted and print on stderr which flag replaces them.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, fields

import torch

from hybridkv.cache.paged import KV_FORMATS
from hybridkv.cache.tiers.config import TierConfig, add_tier_arguments, parse_size, tier_config_from_args
from hybridkv.errors import ConfigError
from hybridkv.memory import parse_policy

INDEXERS = ("native", "random")
SPECULATIVE_METHODS = ("mtp",)
SPECULATIVE_VERIFY = ("auto", "waves", "segments")
DTYPE_CHOICES = ("auto", "bfloat16", "float32")
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
           "float": torch.float32}
# vLLM's --kv-cache-dtype values and the hybridkv entry format each one is ("auto": the model's dtype)
KV_CACHE_DTYPES = {"auto": "native", "bfloat16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8"}


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """The compute dtype to load a model in. "auto" (or None) is bfloat16 on CUDA, where the kernels
    run on tensor cores, and float32 elsewhere, where the model is exact against the reference."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = "auto" if dtype is None else str(dtype).strip().lower().removeprefix("torch.")
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ConfigError(f"unknown compute dtype {dtype!r}; use {', '.join(DTYPE_CHOICES)}")
    return _DTYPES[name]


@dataclass
class EngineConfig:
    kv_format: str = "native"            # native | bf16 | fp8 | v41
    window_policy: str = "full"          # full | checkpoint(N) | zero
    num_blocks: int = 512                # logical blocks of block_tokens positions
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    snapshot_bytes: int = 256 << 20      # window-state snapshots kept for prefix hits
    enable_prefix_caching: bool | None = None   # default: on (with an offloading memory policy too)
    max_model_len: int | None = None     # longest request (default: max_position_embeddings)
    # the CSA KV kept on the device:
    # full | recency-N | recency-p | random-p | oracle-K | flashmemory[-B[-tailT]][-count]
    memory_policy: str = "full"
    memory_indexer: str | None = None    # flashmemory: its weights (default: MODEL_DIR/memory_indexer.safetensors)
    resident_pages: int | None = None    # device pages for resident CSA KV when the policy offloads
    oracle_query_tokens: int = 64        # prompt-end queries whose attention an oracle policy ranks by
    indexer: str = "native"              # native | random (ablation: CSA top-k replaced by a random set)
    indexer_seed: int = 0
    cuda_graphs: bool = True             # replay captured decode steps on CUDA (engine/graphs.py; with
                                         # speculation engine/spec_graphs.py); also off with the
                                         # environment variable HYBRIDKV_CUDA_GRAPHS=0
    # with CUDA graphs: queue the next decode step before reading this one's tokens, so that the host's
    # work (emitting, detokenising, scheduling) runs while the device decodes (engine/core.py)
    async_scheduling: bool = True
    tiers: TierConfig = field(default_factory=TierConfig)   # prefix-cache tiers below the device
    speculative: str | None = None       # "mtp": speculative decoding with the MTP block (engine/speculative.py)
    num_speculative_tokens: int = 1      # draft tokens per step with speculative decoding
    # how verify rows run (engine/speculative.py): "waves" as decode rows, wave by wave (a row's
    # attention is a plain decode step's); "segments" one segment per request; "auto": waves on CUDA,
    # and on the CPU where two or more requests verify in a step (one request's rows cost less as a
    # segment there: BENCHMARKS.md)
    speculative_verify: str = "auto"
    ced_prefill: bool = True             # V4.1: decoder layers only over the rows a later step reads (model/ced.py)
    # decode rows of every request in one batched pass per layer; off: each runs as a one-token
    # segment (the path batched decode is tested and measured against)
    batched_decode: bool = True
    # several processes (engine/sharded.py): the world size; attention heads and vocabulary split
    # over it. Routed experts: whole experts per rank (expert_parallel_size = the world, the default)
    # or every expert's width split (1).
    tensor_parallel_size: int = 1
    expert_parallel_size: int | None = None
    distributed_timeout: float = 120.0   # seconds a collective waits for the other ranks
    # sum: partial sums added across ranks; ordered: bit-equal to one process (distributed/group.py)
    parallel_reduce: str = "sum"

    def __post_init__(self) -> None:
        if isinstance(self.tiers, dict):
            self.tiers = TierConfig(**self.tiers)
        elif self.tiers is None:
            self.tiers = TierConfig(dram_bytes=0)
        if self.kv_format not in KV_FORMATS:
            raise ConfigError(f"unknown KV format {self.kv_format!r}; use {', '.join(KV_FORMATS)}")
        if self.indexer not in INDEXERS:
            raise ConfigError(f"indexer {self.indexer!r}: choose 'native' or 'random'")
        for name in ("num_blocks", "max_num_seqs", "max_num_batched_tokens", "oracle_query_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("max_model_len", "resident_pages"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer (or unset), got {getattr(self, name)!r}")
        self.snapshot_bytes = parse_size(self.snapshot_bytes)
        if self.snapshot_bytes < 0:
            raise ConfigError(f"snapshot_bytes must be >= 0, got {self.snapshot_bytes}")
        if isinstance(self.memory_policy, str) and "," in self.memory_policy:
            raise ConfigError(f"memory policy {self.memory_policy!r} lists several; an engine runs one "
                              f"(`hybridkv eval` takes a list and runs each in turn)")
        parse_policy(self.memory_policy)     # a ConfigError naming the policies, now rather than at the first request
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ConfigError(f"unknown speculative method {self.speculative!r}; use {', '.join(SPECULATIVE_METHODS)}")
        if self.speculative_verify not in SPECULATIVE_VERIFY:
            raise ConfigError(f"speculative_verify {self.speculative_verify!r}: use {', '.join(SPECULATIVE_VERIFY)}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.expert_parallel_size not in (None, 1, self.tensor_parallel_size):
            raise ConfigError(f"expert_parallel_size {self.expert_parallel_size!r}: with tensor_parallel_size "
                              f"{self.tensor_parallel_size}, use {self.tensor_parallel_size} (whole experts per rank) "
                              f"or 1 (every expert's width split over the ranks)")
        if self.parallel_reduce not in ("sum", "ordered"):
            raise ConfigError(f"parallel_reduce {self.parallel_reduce!r}: use 'sum' or 'ordered'")
        if self.parallel_reduce == "ordered" and self.expert_parallel_size == 1 and self.tensor_parallel_size > 1:
            raise ConfigError("parallel_reduce 'ordered' needs whole experts per rank: leave expert_parallel_size "
                              "at the world size")
        if not self.distributed_timeout > 0:
            raise ConfigError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout!r}")
        if (not isinstance(self.num_speculative_tokens, int) or isinstance(self.num_speculative_tokens, bool)
                or self.num_speculative_tokens < 1):
            raise ConfigError(f"num_speculative_tokens must be a positive integer, got {self.num_speculative_tokens!r}")

    # ----- the command line -----
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """The engine options (and the model's --device / --dtype, and the --kv-* tier options) of
        every command that runs an engine. A front end whose defaults differ (eval sizes the pool to
        its prompts) says so with `parser.set_defaults`."""
        add_model_arguments(parser)
        d = EngineConfig()
        g = parser.add_argument_group("engine")
        fmt = g.add_mutually_exclusive_group()
        fmt.add_argument("--kv-format", choices=KV_FORMATS, default=d.kv_format,
                         help="how KV entries are stored: native (the compute dtype, exact), bf16, fp8 (the V4 "
                              "deployment layout), v41 (V4.1's packed layout) (default: %(default)s)")
        fmt.add_argument("--kv-cache-dtype", dest="kv_format", type=_kv_cache_dtype, default=argparse.SUPPRESS,
                         metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
                         help="vLLM's spelling of --kv-format: auto = native, bfloat16 = bf16, fp8 = fp8")
        blocks = g.add_mutually_exclusive_group()
        blocks.add_argument("--num-blocks", type=int, default=d.num_blocks,
                            help=f"KV blocks of 128 positions in the device pool (default: {d.num_blocks}; eval: "
                                 f"sized to its prompts)")
        blocks.add_argument("--num-gpu-blocks-override", dest="num_blocks", type=int, default=argparse.SUPPRESS,
                            help="vLLM's spelling of --num-blocks")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                       help="requests running at once (default: %(default)s)")
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help=f"token budget of one step (default: {d.max_num_batched_tokens}; eval: sized to its "
                            f"prompts)")
        g.add_argument("--max-model-len", type=_token_count, default=d.max_model_len,
                       help="longest request, prompt and output (e.g. 32k; default: the model's "
                            "max_position_embeddings)")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching,
                       help="reuse the KV of earlier requests' prefixes (default: on; with an offloading memory "
                            "policy a hit restores the host copy and the policy chooses what it keeps on the device)")
        g.add_argument("--window-policy", default=d.window_policy,
                       help="the window state kept for prefix hits: full | checkpoint(N) | zero (default: %(default)s)")
        g.add_argument("--ced-prefill", action=argparse.BooleanOptionalAction, default=d.ced_prefill,
                       help="V4.1: run the decoder layers of a prefill only over the rows whose state or output "
                            "is read later (exact; default: on)")
        g.add_argument("--batched-decode", action=argparse.BooleanOptionalAction, default=d.batched_decode,
                       help="run the decode rows of all requests as one batched pass per layer (default: on; off: "
                            "one-token segments, one request at a time)")
        g.add_argument("--snapshot-bytes", type=_size, default=d.snapshot_bytes,
                       help="memory for window-state snapshots kept for prefix hits (e.g. 256M; default 256M)")
        g.add_argument("--memory-policy", default=d.memory_policy,
                       help="the CSA KV kept on the device while decoding: full | recency-N | recency-p | random-p | "
                            "oracle-K | flashmemory[-B[-tailT]][-count] (eval: a comma-separated list, run in turn; "
                            "default: %(default)s)")
        g.add_argument("--memory-indexer", default=d.memory_indexer,
                       help="flashmemory: the memory indexer's weights (default: MODEL_DIR/memory_indexer.safetensors, "
                            "written by hybridkv train-memory-indexer)")
        g.add_argument("--resident-pages", type=int, default=d.resident_pages,
                       help="device pages for resident CSA KV when the memory policy offloads "
                            "(default: --num-blocks)")
        g.add_argument("--oracle-query-tokens", type=int, default=d.oracle_query_tokens,
                       help="prompt-end queries whose attention an oracle policy ranks by (default: %(default)s)")
        g.add_argument("--indexer", choices=INDEXERS, default=d.indexer,
                       help="random: the CSA top-k is a random set of the same size (the indexer ablation)")
        g.add_argument("--indexer-seed", type=int, default=d.indexer_seed,
                       help="seed of the random indexer (default: %(default)s)")
        g.add_argument("--enforce-eager", dest="cuda_graphs", action="store_false",
                       help="launch every decode step eagerly instead of replaying CUDA graphs")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                       help="with CUDA graphs, queue the next decode step before the host reads this step's "
                            "tokens (outputs unchanged) (default: on)")
        g.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=d.speculative,
                       help="speculative decoding: mtp = the checkpoint's MTP block drafts, the model verifies "
                            "(outputs unchanged; steps run without CUDA graphs) (default: off)")
        g.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                       help="draft tokens per step with --speculative (default: %(default)s)")
        g.add_argument("--speculative-verify", choices=SPECULATIVE_VERIFY, default=d.speculative_verify,
                       help="how verify rows run: waves = as decode rows, wave by wave; segments = one segment per "
                            "request; auto = waves on CUDA, and on the CPU when two or more requests verify "
                            "(default: %(default)s)")
        g.add_argument("--speculative-config", action=_SpeculativeConfig, default=argparse.SUPPRESS,
                       metavar="JSON", help="vLLM's spelling: '{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'")
        par = parser.add_argument_group("several processes")
        par.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                         help="processes (one per GPU) the model is split over: attention heads, vocabulary and "
                              "experts (default: %(default)s)")
        par.add_argument("--expert-parallel-size", type=int, default=d.expert_parallel_size,
                         help="routed experts: the world size (default) holds whole experts per rank; 1 splits "
                              "every expert's width")
        par.add_argument("--parallel-reduce", choices=("sum", "ordered"), default=d.parallel_reduce,
                         help="sum: add the ranks' partial sums (fast; float round-off differs from one process); "
                              "ordered: gather the parts and add them in one process's order, bit-equal to it "
                              "(more traffic, output projections and shared expert whole on every rank)")
        par.add_argument("--distributed-timeout", type=float, default=d.distributed_timeout,
                         help="seconds a collective waits for the other ranks before the engine stops with an "
                              "error (default: %(default)s)")
        old = parser.add_argument_group("deprecated spellings")
        old.add_argument("--max-concurrency", dest="max_num_seqs", type=int, action=_Renamed, new="--max-num-seqs",
                         default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        old.add_argument("--max-batched-tokens", dest="max_num_batched_tokens", type=int, action=_Renamed,
                         new="--max-num-batched-tokens", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        old.add_argument("--policy", dest="memory_policy", action=_Renamed, new="--memory-policy",
                         default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        old.add_argument("--prefix-cache", dest="window_policy", action=_PrefixCache, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)
        add_tier_arguments(parser)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> "EngineConfig":
        """The config a parsed command line asks for (`overrides` win)."""
        return cls(**{**engine_options(args), **overrides})


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig fields a parsed command line sets: every engine option whose value is not
    None (a front end that sizes an option itself defaults it to None), and the tiers."""
    out = {f.name: getattr(args, f.name) for f in fields(EngineConfig)
           if f.name != "tiers" and getattr(args, f.name, None) is not None}
    out["tiers"] = tier_config_from_args(args)
    return out


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--device and --dtype: where the model runs and the dtype it computes in."""
    g = parser.add_argument_group("model")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: %(default)s)")
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="compute dtype; auto = bfloat16 on CUDA (tensor cores), float32 elsewhere (exact against "
                        "the reference) (default: %(default)s)")


def _kv_cache_dtype(text: str) -> str:
    if text not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(KV_CACHE_DTYPES)} "
                                         f"(hybridkv's own formats: --kv-format {'|'.join(KV_FORMATS)})")
    return KV_CACHE_DTYPES[text]


def _token_count(text: str) -> int:
    """'32k' -> 32768, '1M' -> 1048576, '4096' -> 4096."""
    t = text.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 4096, 32k, 1M)") from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _deprecated(old: str, new: str) -> None:
    print(f"warning: {old} is deprecated; use {new}", file=sys.stderr)


class _Renamed(argparse.Action):
    """An option's earlier spelling: stores what the new flag would, and says which flag that is."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        _deprecated(option_string, self.new)
        setattr(namespace, self.dest, values)


class _PrefixCache(argparse.Action):
    """serve's earlier --prefix-cache off | full | checkpoint(N) | zero: prefix caching on or off and
    the window policy, now two options."""

    def __call__(self, parser, namespace, values, option_string=None):
        t = values.strip().lower()
        if t == "off":
            _deprecated(f"{option_string} off", "--no-enable-prefix-caching")
            namespace.enable_prefix_caching = False
        else:
            _deprecated(f"{option_string} {values}", f"--enable-prefix-caching --window-policy {values}")
            namespace.enable_prefix_caching, namespace.window_policy = True, values


class _SpeculativeConfig(argparse.Action):
    """vLLM's --speculative-config JSON: its "method" and "num_speculative_tokens" keys."""

    def __call__(self, parser, namespace, values, option_string=None):
        import json
        try:
            cfg = json.loads(values)
        except json.JSONDecodeError as e:
            parser.error(f"{option_string}: not JSON ({e}): {values!r}")
        if not isinstance(cfg, dict) or set(cfg) - {"method", "num_speculative_tokens"}:
            parser.error(f"{option_string} takes an object with \"method\" and \"num_speculative_tokens\"; "
                         f"got {values!r}")
        method = cfg.get("method", "mtp")
        if method not in SPECULATIVE_METHODS:
            parser.error(f"{option_string}: method {method!r} is not one of {', '.join(SPECULATIVE_METHODS)}")
        namespace.speculative = method
        if "num_speculative_tokens" in cfg:
            namespace.num_speculative_tokens = cfg["num_speculative_tokens"]
