"""Training recipes, as data: the model (a release-format config.json dict), the tokenizer, the
data mix, the length curriculum with the DSA warm-up and the late FP4 QAT switch, and the
optimisation settings.

- `smoke`, `smoke-v41`: seconds on a CPU (V4 and V4.1 models); the CI tests assert their loss drops.
- `tiny-v4`: from scratch, a task curriculum (passkey alone, then the needle families, then every
  family) before the length curriculum (1K to 32K).
- `tiny-v4-needles`, `tiny-v4-keys`, `tiny-v4-hexsplit`, `tiny-v4-polish`, `tiny-v4-anypos`,
  `tiny-v4-long`: each continues the export of the one before it (`--init-from`); the weight average
  of the `tiny-v4-anypos` and `tiny-v4-long` exports (`python -m hybridkv.train.average A B
  --weight 0.5`) is the base of the prose recipes.
- `tiny-v41`: tiny-v4's data, curriculum and parameter budget on a DeepSeek-V4.1 model (the V4 vs
  V4.1 comparison, docs/v4-vs-v41.md). `tiny-v41-wide`: the same with a top-k and a candidate pool
  scaled to V4.1's finer entries, the Reuse layers' attention in the indexers' target, the
  indexers' gradients clipped apart, and the top-k from the 2K stage on. `tiny-v41-needles`
  continues its export on the needle families at 4K-16K, as `tiny-v4-needles` continued `tiny-v4`.
- `tiny-v4-prose`: continues that average on its needle mix with half of every needle family's
  rows hiding the needles in real prose (`realtext_share`; the training part of
  `hybridkv.tasks.prose`), 2K to 32K. `tiny-v41-prose`: `tiny-v41` on the same mix (half of each
  stage's rows of a family with a real-text variant over real prose).
- `tiny-v4-prose-keys`: continues the `tiny-v4-prose` export with multi-key needles and their
  hard drill over half the rows (`--init-from` that export).
- `tiny-v4-prose-uuid`: continues the `tiny-v4-prose-keys` export with UUID needles over a third
  of the rows, 2K to 16K, multi-key kept.
- `tiny-v4-mtp-chain`: continues the `tiny-v4-prose-uuid` export training only its MTP block
  (`trains`), also as the engine chains it for a second draft (`mtp_chain`); its export keeps the
  base's other tensors byte for byte. Its export is the shipped model (`models/tiny-v4`).

The recipes tried and dropped, with their results, are in docs/training-log.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial

from hybridkv.errors import TrainingError
from hybridkv.train.losses import LossWeights


@dataclass(frozen=True)
class Stage:
    until: int               # the step at which this stage ends
    seq_len: int
    batch: int
    dense_indexer: bool      # DSA warm-up: CSA attends to all visible entries, the indexer learns by KL
    qat_experts: bool = False
    tasks: dict[str, float] | None = None   # the task mix of this stage (default: the recipe's)


@dataclass
class Recipe:
    name: str
    model: dict
    vocab_size: int
    tokenizer_texts: int
    steps: int
    stages: list[Stage]
    lr: float = 3e-3
    warmup: int = 100
    final_lr_frac: float = 0.1
    clip: float = 1.0
    bias_rate: float = 1e-3
    loss: LossWeights = field(default_factory=LossWeights)
    task_weights: dict[str, float] | None = None
    kl_queries: int = 256
    # V4.1: the Reuse layers' attention also trains the indexer whose top-k they read (else only the
    # Full/Reindex layer's own attention does)
    reuse_layers_train_indexer: bool = False
    # the indexer's gradients clipped apart from the model's, at this norm (None: one clip over all,
    # so the indexer's KL gradients scale the model's update)
    indexer_clip: float | None = None
    log_every: int = 10
    seed: int = 0
    # the seed of the haystack material (filler sentences, distractor needles); None: `seed`. A
    # continuation that keeps its base's filler spends its steps on the answers instead of on
    # learning a new set of filler sentences
    filler_seed: int | None = None
    base: str | None = None   # the recipe whose exported model this one continues (`--init-from`)
    hex_chars: bool = False   # the tokenizer keeps every character of a hex run with a digit apart
    adds_hex_chars: bool = False   # the base's tokenizer lacks that rule: the run adds it, vocabulary kept
    # > 0: each row goes on after its answer's EOS with a next document's start of up to this many
    # tokens, so that answers end anywhere within the compression blocks (`training_example`)
    next_document: int = 0
    # this share of every task's weight goes to its real-text variant (`with_realtext`), in every stage
    realtext_share: float = 0.0
    # only the parameters named with this prefix train ("mtp.": the MTP block, the rest frozen and
    # run without gradients); None: all of them
    trains: str | None = None
    # the last MTP block also trained as the engine chains it for a second draft (`train.forward`)
    mtp_chain: int = 0

    def __post_init__(self):
        if not 0.0 <= self.realtext_share <= 1.0:
            raise TrainingError(f"recipe {self.name!r}: realtext_share must be within [0, 1], "
                                f"got {self.realtext_share}")

    @property
    def pool_seed(self) -> int:
        """The seed the run's filler sentences and distractor needles are drawn with."""
        return self.seed if self.filler_seed is None else self.filler_seed

    def stage(self, step: int) -> Stage:
        for s in self.stages:
            if step < s.until:
                return s
        return self.stages[-1]

    def task_mix(self, step: int) -> dict[str, float] | None:
        mix = self.stage(step).tasks or self.task_weights
        return with_realtext(mix, self.realtext_share) if self.realtext_share else mix

    def tokens(self) -> int:
        """Tokens of the whole run."""
        return sum(self.stage(i).seq_len * self.stage(i).batch for i in range(self.steps))


def with_realtext(mix: dict[str, float] | None, share: float) -> dict[str, float]:
    """`mix` (None: uniform over the default training tasks) with `share` of the weight of every
    task that has a real-text variant moved to that variant (`passkey` -> `passkey_realtext`); the
    other tasks keep theirs."""
    from hybridkv.tasks.generators import REALTEXT_FAMILIES, TRAIN_TASKS, realtext_task
    out: dict[str, float] = {}
    for task, weight in (mix or dict.fromkeys(TRAIN_TASKS, 1.0)).items():
        if task in REALTEXT_FAMILIES and share > 0:
            out[task] = out.get(task, 0.0) + weight * (1 - share)
            variant = realtext_task(task)
            out[variant] = out.get(variant, 0.0) + weight * share
        else:
            out[task] = out.get(task, 0.0) + weight
    return {t: w for t, w in out.items() if w > 0}


_V4_BASE = {
    "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
    "num_key_value_heads": 1, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "norm_topk_prob": True, "topk_method": "noaux_tc",
    "swiglu_limit": 10.0, "sliding_window": 128, "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

TINY_V4_MODEL = {
    **_V4_BASE,
    "hidden_size": 256, "num_hidden_layers": 6, "num_nextn_predict_layers": 1, "num_hash_layers": 2,
    "num_attention_heads": 4, "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128,
    "o_groups": 2, "o_lora_rank": 64,
    # pure-window, then CSA (ratio 4) and HCA (ratio 128) interleaved; the MTP layer is window-only
    "compress_ratios": [0, 4, 128, 4, 128, 4, 0],
    "index_n_heads": 4, "index_head_dim": 64, "index_topk": 64,
    "n_routed_experts": 8, "moe_intermediate_size": 128,
    "max_position_embeddings": 65536, "expert_dtype": "fp4",
}

SMOKE_MODEL = {
    **_V4_BASE,
    "hidden_size": 128, "num_hidden_layers": 3, "num_nextn_predict_layers": 1, "num_hash_layers": 1,
    "num_attention_heads": 2, "head_dim": 96, "qk_rope_head_dim": 32, "q_lora_rank": 32,
    "o_groups": 2, "o_lora_rank": 16, "compress_ratios": [0, 4, 128, 0],
    "index_n_heads": 2, "index_head_dim": 32, "index_topk": 8,
    "n_routed_experts": 4, "moe_intermediate_size": 128, "max_position_embeddings": 4096,
    "torch_dtype": "float32", "expert_dtype": "fp4",
}


# every task family of hybridkv.tasks, weighted toward the needles
_ALL_FAMILIES = {"passkey": 0.2, "niah_single_1": 0.05, "niah_single_2": 0.1, "niah_single_3": 0.05,
                 "niah_multikey_1": 0.1, "niah_multikey_2": 0.05, "niah_multikey_3": 0.05,
                 "niah_multivalue": 0.05, "niah_multiquery": 0.05, "vt": 0.1, "assoc": 0.1, "copy": 0.1}

_NEEDLES = {"passkey": 0.4, "niah_single_1": 0.2, "niah_single_2": 0.2, "niah_single_3": 0.2}

# the continuations' mixes: the needle families; then UUID (niah_single_3) and multi-key needles
# with the solved families kept; then those two with the `niah_multikey_hard` drill
_NEEDLE_FOCUS = {"passkey": 0.1, "niah_single_1": 0.15, "niah_single_2": 0.15, "niah_single_3": 0.2,
                 "niah_multikey_1": 0.2, "niah_multikey_2": 0.05, "niah_multikey_3": 0.05,
                 "niah_multivalue": 0.05, "niah_multiquery": 0.05}
_KEY_FOCUS = {"passkey": 0.05, "niah_single_1": 0.1, "niah_single_2": 0.1, "niah_single_3": 0.3,
              "niah_multikey_1": 0.3, "niah_multikey_2": 0.05, "niah_multikey_3": 0.05, "niah_multiquery": 0.05}
_UUID_AND_KEYS_FOCUS = {"niah_single_3": 0.35, "niah_multikey_1": 0.25, "niah_multikey_hard": 0.1, "passkey": 0.05,
                        "niah_single_1": 0.1, "niah_single_2": 0.1, "niah_multiquery": 0.05}


SMOKE_V41_MODEL = {
    "model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"],
    "hidden_size": 128, "num_hidden_layers": 6, "num_hash_layers": 0, "num_nextn_predict_layers": 0,
    "num_attention_heads": 2, "num_key_value_heads": 1, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "moe_intermediate_size": 128, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "norm_topk_prob": True, "topk_method": "noaux_tc", "swiglu_limit": 10.0,
    "q_lora_rank": 32, "head_dim": 64, "qk_rope_head_dim": 32, "o_groups": 2, "o_lora_rank": 16,
    "sliding_window": 128,
    # Full (source) layers 2 and 4; 3 reuses 2; 5 re-indexes 4's keys inside its candidate pool
    "compress_ratios": [0, 0, 2, 2, 1, 1], "kv_source_layer_ids": [2, 4], "index_source_layer_ids": [2, 4, 5],
    "candidate_source_layer_id": 4, "candidate_topk_blocks": 4, "candidate_block_size": 8,
    "compress_rope_theta": 160000.0, "rope_theta": 10000.0, "index_n_heads": 2, "index_head_dim": 32,
    "index_topk": 16, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "torch_dtype": "float32", "expert_dtype": "fp4",
}


def _tiny_v4() -> Recipe:
    """From scratch: passkey alone, then the needle families, then every family at 1K-2K with the
    dense indexer; then the indexer's top-64 from 4K to 32K, FP4 QAT of the experts at the end."""
    return Recipe(
        name="tiny-v4", model=TINY_V4_MODEL, vocab_size=4096, tokenizer_texts=20000, steps=2750,
        stages=[Stage(300, 1024, 32, dense_indexer=True, tasks={"passkey": 1.0}),
                Stage(700, 1024, 32, dense_indexer=True, tasks=_NEEDLES),
                Stage(1200, 2048, 16, dense_indexer=True, tasks=_ALL_FAMILIES),
                Stage(1700, 4096, 8, dense_indexer=False),
                Stage(2150, 8192, 4, dense_indexer=False),
                Stage(2500, 16384, 2, dense_indexer=False),
                Stage(2650, 32768, 1, dense_indexer=False),
                Stage(2750, 32768, 1, dense_indexer=False, qat_experts=True)],
        lr=3e-3, warmup=50, log_every=20, task_weights=_ALL_FAMILIES,
    )


@dataclass(frozen=True)
class _Continuation:
    """A recipe continuing `base`'s export (on tiny-v4's model unless `model` says otherwise):
    stages of (until step, length, batch), every one with the indexer's top-k and the experts' FP4
    QAT (the weights start on the FP4 grid they ship on), after a 30-step warm-up."""
    base: str
    schedule: tuple[tuple[int, int, int], ...]
    mix: dict[str, float]
    seed: int
    lr: float = 1e-3
    model: dict | None = None
    reuse_layers_train_indexer: bool = False
    indexer_clip: float | None = None
    hex_chars: bool = False
    adds_hex_chars: bool = False
    filler_seed: int | None = None
    answer_weight: float = 1.0
    next_document: int = 0
    realtext_share: float = 0.0
    trains: str | None = None
    mtp_chain: int = 0
    mtp_weight: float = 0.3
    warmup: int = 30

    def recipe(self, name: str) -> Recipe:
        stages = [Stage(until, seq_len, batch, dense_indexer=False, qat_experts=True)
                  for until, seq_len, batch in self.schedule]
        return Recipe(name=name, model=self.model or TINY_V4_MODEL, vocab_size=4096, tokenizer_texts=20000,
                      steps=stages[-1].until, stages=stages, lr=self.lr, warmup=self.warmup, log_every=20,
                      task_weights=self.mix, base=self.base, seed=self.seed, filler_seed=self.filler_seed,
                      loss=LossWeights(answer=self.answer_weight, mtp=self.mtp_weight),
                      hex_chars=self.hex_chars or self.adds_hex_chars, trains=self.trains, mtp_chain=self.mtp_chain,
                      adds_hex_chars=self.adds_hex_chars, next_document=self.next_document,
                      realtext_share=self.realtext_share,
                      reuse_layers_train_indexer=self.reuse_layers_train_indexer, indexer_clip=self.indexer_clip)


_POLISH_SCHEDULE = ((200, 1024, 32), (350, 2048, 16), (550, 4096, 8), (700, 8192, 4), (800, 16384, 2))
# the settings tiny-v4-polish and what continues it share: hexsplit's filler, answers weighted 4x
_ON_HEXSPLIT_FILLER = dict(mix=_UUID_AND_KEYS_FOCUS, hex_chars=True, filler_seed=9, answer_weight=4.0)

# the shipped model's lineage, each continuing the export of the one before
_CONTINUATIONS = {
    # the needle families at 4K-32K
    "tiny-v4-needles": _Continuation("tiny-v4", ((500, 4096, 8), (1000, 8192, 4), (1300, 16384, 2),
                                                 (1400, 32768, 1)), _NEEDLE_FOCUS, seed=1),
    # UUID and multi-key needles at 4K-16K, the lengths of their bars
    "tiny-v4-keys": _Continuation("tiny-v4-needles", ((500, 4096, 8), (1000, 8192, 4), (1250, 16384, 2)),
                                  _KEY_FOCUS, seed=2),
    # adds the hex rule to its base's tokenizer (vocabulary kept); short sequences first
    "tiny-v4-hexsplit": _Continuation("tiny-v4-keys", ((300, 1024, 32), (500, 2048, 16), (800, 4096, 8),
                                                       (1000, 8192, 4), (1150, 16384, 2)),
                                      _UUID_AND_KEYS_FOCUS, seed=9, adds_hex_chars=True),
    # fresh examples on the filler its base learned, answers weighted 4x, half the lr
    "tiny-v4-polish": _Continuation("tiny-v4-hexsplit", _POLISH_SCHEDULE, seed=11, lr=5e-4, **_ON_HEXSPLIT_FILLER),
    # each row goes on after its answer with a next document's start (0-127 tokens), so that
    # answers end anywhere within the compression blocks
    "tiny-v4-anypos": _Continuation("tiny-v4-polish", _POLISH_SCHEDULE, seed=13, lr=5e-4, next_document=128,
                                    **_ON_HEXSPLIT_FILLER),
    # three times anypos' 16K steps
    "tiny-v4-long": _Continuation("tiny-v4-anypos", ((100, 2048, 16), (250, 4096, 8), (400, 8192, 4),
                                                     (700, 16384, 2)), seed=14, lr=3e-4, next_document=128,
                                  **_ON_HEXSPLIT_FILLER),
}
# the shipped model's last three steps (docs/training-log.md, 2026-12-02). The first continues the
# weight average of tiny-v4-anypos and tiny-v4-long (same model and tokenizer as tiny-v4-long's
# export, so its `base` is tiny-v4-long). Half of every
# needle family's rows over real prose, at 2K to 32K (the real-text bars go to 32K); multi-key
# weighted up for its 8K bar
_PROSE_CONTINUATIONS = {
    "tiny-v4-prose": _Continuation("tiny-v4-long", ((60, 2048, 16), (200, 4096, 8), (360, 8192, 4),
                                                    (530, 16384, 2), (600, 32768, 1)),
                                   {"passkey": 0.15, "niah_single_1": 0.1, "niah_single_2": 0.15, "niah_single_3": 0.2,
                                    "niah_multikey_1": 0.25, "niah_multikey_hard": 0.1, "niah_multiquery": 0.05},
                                   seed=15, lr=3e-4, hex_chars=True, filler_seed=9, answer_weight=4.0,
                                   next_document=128, realtext_share=0.5),
    # continues tiny-v4-prose's export: telling the four keys of a multi-key prompt apart (its misses
    # were another needle's value), multi-key and its drill (distractor keys sharing a word with the
    # asked key) over half the rows, 2K to 32K, the other needle families kept
    "tiny-v4-prose-keys": _Continuation("tiny-v4-prose", ((40, 2048, 16), (200, 4096, 8), (380, 8192, 4),
                                                          (480, 16384, 2), (520, 32768, 1)),
                                        {"passkey": 0.1, "niah_single_1": 0.1, "niah_single_2": 0.1,
                                         "niah_single_3": 0.1, "niah_multikey_1": 0.3, "niah_multikey_hard": 0.25,
                                         "niah_multiquery": 0.05},
                                        seed=16, lr=2e-4, hex_chars=True, filler_seed=9, answer_weight=4.0,
                                        next_document=128, realtext_share=0.5),
    # continues tiny-v4-prose-keys' export: copying a UUID exactly (its UUID misses were the needle
    # with two hex characters swapped or one dropped), UUIDs over a third of the rows at the lengths
    # of their bars, multi-key and its drill kept at 0.3
    "tiny-v4-prose-uuid": _Continuation("tiny-v4-prose-keys", ((40, 2048, 16), (220, 4096, 8), (420, 8192, 4),
                                                               (520, 16384, 2)),
                                        {"passkey": 0.1, "niah_single_1": 0.05, "niah_single_2": 0.1,
                                         "niah_single_3": 0.35, "niah_multikey_1": 0.2, "niah_multikey_hard": 0.1,
                                         "niah_multiquery": 0.1},
                                        seed=17, lr=2e-4, hex_chars=True, filler_seed=9, answer_weight=4.0,
                                        next_document=128, realtext_share=0.5),
    # the shipped model's MTP block alone (the rest frozen: the main model's outputs stay bit for bit),
    # trained on the shipped model's mix also as the engine chains it for a second draft, which its
    # depth-0 training never showed it
    "tiny-v4-mtp-chain": _Continuation("tiny-v4-prose-uuid", ((400, 2048, 2),),
                                       {"passkey": 0.1, "niah_single_1": 0.05, "niah_single_2": 0.1,
                                        "niah_single_3": 0.35, "niah_multikey_1": 0.2, "niah_multikey_hard": 0.1,
                                        "niah_multiquery": 0.1},
                                       seed=23, lr=5e-4, hex_chars=True, filler_seed=9, next_document=128,
                                       realtext_share=0.5, trains="mtp.", mtp_chain=1, mtp_weight=1.0),
}


TINY_V41_MODEL = {
    **{k: v for k, v in TINY_V4_MODEL.items() if k not in ("num_hash_layers", "num_nextn_predict_layers")},
    "model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"],
    # seven blocks like tiny-v4's six + MTP: a window layer, then Full (ratio 2) / Reuse, Full (ratio 1) /
    # Reuse / Reindex (inside the candidate pool of 64 blocks of 8) / Reuse
    "num_hidden_layers": 7, "num_nextn_predict_layers": 0, "num_hash_layers": 0,
    "compress_ratios": [0, 2, 2, 1, 1, 1, 1], "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 3, 5],
    "candidate_source_layer_id": 3, "candidate_topk_blocks": 64, "candidate_block_size": 8,
}


# tiny-v41's model with the selection scaled to V4.1's finer entries: a top-k whose ratio-1 entries
# cover the 256 tokens tiny-v4's top-64 ratio-4 entries cover, and a candidate pool 32 times the top-k
# (1,024 blocks of 8), as V4.1-Flash pairs its top-512 with a pool of 16,384 positions
TINY_V41_WIDE_MODEL = {**TINY_V41_MODEL, "index_topk": 256, "candidate_topk_blocks": 1024}
SPARSE_FROM_2K = 950      # tiny-v41-wide's switch to the top-k, halfway through the 2K stage (700-1200)


def _tiny_v41() -> Recipe:
    """tiny-v4's data and curriculum on a DeepSeek-V4.1 model of about the same size; its longest
    stage is 16K x 1 (the training forward computes CSA logits densely, and ratio-1 layers have an
    entry per token)."""
    r = _tiny_v4()
    stages = [st for st in r.stages if st.seq_len <= 8192]
    stages += [Stage(2650, 16384, 1, dense_indexer=False), Stage(2750, 16384, 1, dense_indexer=False,
                                                                  qat_experts=True)]
    return Recipe(name="tiny-v41", model=TINY_V41_MODEL, vocab_size=r.vocab_size,
                  tokenizer_texts=r.tokenizer_texts, steps=r.steps, stages=stages, lr=r.lr, warmup=r.warmup,
                  log_every=r.log_every, task_weights=r.task_weights)


def _tiny_v41_wide() -> Recipe:
    """tiny-v41 (data, lengths, budget) with `TINY_V41_WIDE_MODEL`'s selection, the Reuse layers'
    attention in the indexer's KL target, the indexer's gradients clipped apart, and the top-k from
    the second half of the 2K stage (step 950) on, so that attention turns sparse before the length
    grows: the next V4.1 experiment after tiny-v41 lost retrieval when its top-64 selection began at
    4K (docs/v4-vs-v41.md, docs/training-log.md 2026-12-04)."""
    r = _tiny_v41()
    stages = []
    for st in r.stages:
        if st.seq_len == 2048 and st.dense_indexer:
            stages.append(replace(st, until=SPARSE_FROM_2K))
            st = replace(st, dense_indexer=False)
        stages.append(st)
    return replace(r, name="tiny-v41-wide", model=TINY_V41_WIDE_MODEL, stages=stages,
                   reuse_layers_train_indexer=True, indexer_clip=1.0)



# continues tiny-v41-wide's export as tiny-v4-needles continued tiny-v4's: the needle families at
# 4K-16K (16K x 1, tiny-v41's longest stage), the indexer trained as in tiny-v41-wide; 600 steps
# against tiny-v4-needles' 1400, so that the run and the evaluation fit one GPU command
_V41_CONTINUATIONS = {
    "tiny-v41-needles": _Continuation("tiny-v41-wide", ((200, 4096, 8), (400, 8192, 4), (600, 16384, 1)),
                                      _NEEDLES, seed=1, model=TINY_V41_WIDE_MODEL,
                                      reuse_layers_train_indexer=True, indexer_clip=1.0),
}


def _tiny_v41_prose() -> Recipe:
    """tiny-v41 with tiny-v4-prose's real-text share: half of the rows of every family with a
    real-text variant hide their needles in the training part of the real prose."""
    share = _PROSE_CONTINUATIONS["tiny-v4-prose"].realtext_share
    return replace(_tiny_v41(), name="tiny-v41-prose", realtext_share=share)


def _smoke() -> Recipe:
    return Recipe(
        name="smoke", model=SMOKE_MODEL, vocab_size=512, tokenizer_texts=300, steps=30,
        stages=[Stage(15, 512, 2, dense_indexer=True), Stage(27, 640, 2, dense_indexer=False),
                Stage(30, 640, 2, dense_indexer=False, qat_experts=True)],
        lr=3e-3, warmup=5, log_every=5, kl_queries=32,
        task_weights={"passkey": 1.0, "niah_single_2": 1.0, "copy": 1.0},
    )


def _smoke_v41() -> Recipe:
    """The smoke recipe on a DeepSeek-V4.1 model (CSA2 layer sharing, single-pass mHC, no MTP)."""
    return replace(_smoke(), name="smoke-v41", model=SMOKE_V41_MODEL)


RECIPES = {
    "smoke": _smoke, "smoke-v41": _smoke_v41, "tiny-v4": _tiny_v4,
    **{name: partial(c.recipe, name) for name, c in _CONTINUATIONS.items()},
    "tiny-v41": _tiny_v41,
    "tiny-v41-wide": _tiny_v41_wide,
    **{name: partial(c.recipe, name) for name, c in _V41_CONTINUATIONS.items()},
    **{name: partial(c.recipe, name) for name, c in _PROSE_CONTINUATIONS.items()},
    "tiny-v41-prose": _tiny_v41_prose,
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise TrainingError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]()
