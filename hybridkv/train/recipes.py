"""Training recipes: the model (a release-format config.json dict), the tokenizer, the data mix, the
length curriculum with the DSA warm-up and the late FP4 QAT switch, and the optimisation settings.

- `smoke`, `smoke-v41`: seconds on a CPU (V4 and V4.1 models); the CI tests assert their loss drops.
- `tiny-v4`: from scratch, a task curriculum (passkey alone, then the needle families, then every
  family) before the length curriculum (1K to 32K), trained on one H200 in two commands of ≤ 10
  minutes (`--max-minutes` checkpoints and `--resume` continues). The shipped model
  (`models/tiny-v4`) is its export continued by `tiny-v4-needles`, `tiny-v4-keys`,
  `tiny-v4-hexsplit`, `tiny-v4-polish`, then `tiny-v4-anypos`.
- `tiny-v41`: the same data, curriculum and parameter budget on a DeepSeek-V4.1 model (the V4 vs
  V4.1 comparison, docs/v4-vs-v41.md).
- `tiny-v4-needles`: continues a `tiny-v4` model (`--init-from`) on the needle families at 4K-32K,
  where the task curriculum left it short of the NIAH bars (one H200 command).
- `tiny-v4-keys`: continues a `tiny-v4-needles` model on UUID and multi-key needles at 4K-16K,
  which that one still missed (one H200 command).
- `tiny-v4-distractors`: continues a `tiny-v4-keys` model on multi-key needles whose distractor
  keys share a word with the asked key, and on UUID needles from 2K up (trained once; not shipped:
  the model card says why).
- `tiny-v4-copy`: continues a `tiny-v4-keys` model with most steps at 1K-4K, where one sequence
  per example makes UUID answers cheap (trained once: UUID needles 45 → 65 % at 16K, still short of
  the bar, and values lose or repeat their last character; not shipped, see the model card).
- `tiny-v4-hex`: tiny-v4 with a tokenizer that keeps every character of a hex run holding a digit
  apart, for UUID copies. `tiny-v4-hex-keys` continues it on tiny-v4-keys' mix, and
  `tiny-v4-hex-copy` continues that on UUID-heavy short sequences. Trained once each; UUID
  needles 90 / 70 / 65 % at 4K / 8K / 16K, but multi-key needles at chance. Not shipped; the model
  card says why. `tiny-v4-hex-multikey` continues `tiny-v4-hex-copy` on multi-key needles (not
  trained yet).
- `tiny-v4-hexsplit`: continues a `tiny-v4-keys` model with the hex rule added to its own tokenizer
  (vocabulary kept), on UUID and multi-key needles from 1K to 16K (one H200 command).
  `tiny-v4-hexsplit-2`, a second pass, was trained once and not shipped.
- `tiny-v4-polish`: continues a `tiny-v4-hexsplit` model on the filler that run learned (the
  examples fresh), with the answers' loss weighted four times, at half its learning rate (one
  H200 command).
- `tiny-v4-stop`: continues a `tiny-v4-polish` model with the answers' closing tokens (period, EOS)
  weighted up, for UUIDs that run on past their end (trained once; not shipped: it did not stop them).
- `tiny-v4-anypos`: continues a `tiny-v4-polish` model with each row going on after its answer
  with a next document's start, so that answers end anywhere within the compression blocks (one
  H200 command; the shipped model).
- `tiny-v4-long`: continues a `tiny-v4-anypos` model on the same mix with three times its 16K
  steps, where its UUID copies still miss a character or two (one H200 command). Its export
  alone gains UUIDs at 16K and loses multi-key needles at 8K; the shipped model is the average of
  the two (`python -m hybridkv.train.average`).
- `tiny-v4-r1`: the first tiny-v4 recipe, twelve task families mixed from step 0; kept because
  the model it trained never retrieved, which is what the task curriculum of `tiny-v4` fixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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
        return self.stage(step).tasks or self.task_weights

    def tokens(self) -> int:
        """Tokens of the whole run."""
        return sum(self.stage(i).seq_len * self.stage(i).batch for i in range(self.steps))


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

_RETRIEVAL_MIX = {"passkey": 0.25, "niah_single_1": 0.1, "niah_single_2": 0.15, "niah_single_3": 0.05,
                  "niah_multikey_1": 0.15, "niah_multikey_2": 0.05, "niah_multivalue": 0.05, "copy": 0.1,
                  "assoc": 0.1}


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


def _tiny_v4_r1() -> Recipe:
    """The first tiny-v4 recipe; its model never retrieved (answers at chance). Phase 1 (steps
    0-1541) ran the first length curriculum; its tasks were not yet retrieved, so phase 2 returns to
    1K-token contexts with every CSA entry visible and a retrieval-heavy mix before growing the
    length again."""
    return Recipe(
        name="tiny-v4-r1", model=TINY_V4_MODEL, vocab_size=4096, tokenizer_texts=20000, steps=3041,
        stages=[Stage(324, 2048, 16, dense_indexer=True),
                Stage(810, 4096, 8, dense_indexer=False),
                Stage(1485, 8192, 4, dense_indexer=False),
                Stage(1541, 16384, 2, dense_indexer=False),
                # phase 2
                Stage(2341, 1024, 32, dense_indexer=True, tasks=_RETRIEVAL_MIX),
                Stage(2741, 4096, 8, dense_indexer=False, tasks=_RETRIEVAL_MIX),
                Stage(2941, 16384, 2, dense_indexer=False),
                Stage(3041, 32768, 1, dense_indexer=False, qat_experts=True)],
        lr=3e-3, warmup=100, log_every=20,
        task_weights=_ALL_FAMILIES,
    )


_NEEDLES = {"passkey": 0.4, "niah_single_1": 0.2, "niah_single_2": 0.2, "niah_single_3": 0.2}


def _tiny_v4() -> Recipe:
    """The shipped model's base: from scratch, a task curriculum before the length one. The architecture
    learns passkey alone at 1K in ~200 steps (benchmarks/retrieval_probe.py), while the twelve-family
    mix from step 0 of `tiny-v4-r1` never left chance; so retrieval is learned on one task first,
    then the needle families, then everything, then the lengths. 16 minutes on one H200."""
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


def _tiny_v4_hex() -> Recipe:
    """tiny-v4 with one change, the tokenizer: every character of a hex run holding a digit is its
    own token (`hybridkv.tasks.tokenizer`). The shipped model copies 7-digit values exactly but
    UUIDs with a few characters wrong, and the first wrong character sits on a merged letter token
    (`cf`, `ed`, `bab`) in 8 of the 10 prompts whose UUID lies inside the sliding window when the
    answer starts, all 10 of which it miscopies (models/tiny-v4/README.md): it is the copy, not the
    retrieval. Same data seed and curriculum as tiny-v4, so the two bases compare."""
    return replace(_tiny_v4(), name="tiny-v4-hex", hex_chars=True)


# what the `tiny-v4` model still missed: exact 7-digit and UUID copies, and the right
# key among distractor needles
_NEEDLE_FOCUS = {"passkey": 0.1, "niah_single_1": 0.15, "niah_single_2": 0.15, "niah_single_3": 0.2,
                 "niah_multikey_1": 0.2, "niah_multikey_2": 0.05, "niah_multikey_3": 0.05,
                 "niah_multivalue": 0.05, "niah_multiquery": 0.05}


def _continuation(name: str, schedule: list[tuple[int, int, int]], task_weights: dict[str, float], base: str,
                  seed: int, hex_chars: bool = False, adds_hex_chars: bool = False, filler_seed: int | None = None,
                  answer_weight: float = 1.0, answer_end_weight: float = 0.0, lr: float = 1e-3,
                  next_document: int = 0) -> Recipe:
    """A recipe continuing `base`'s export on tiny-v4's model: stages of (until step, length, batch),
    all with the indexer's top-k and the experts' FP4 QAT (the weights start on the FP4 grid they
    ship on), lr 1e-3 (unless given) after a 30-step warm-up."""
    stages = [Stage(until, seq_len, batch, dense_indexer=False, qat_experts=True) for until, seq_len, batch in schedule]
    return Recipe(name=name, model=TINY_V4_MODEL, vocab_size=4096, tokenizer_texts=20000, steps=stages[-1].until,
                  stages=stages, lr=lr, warmup=30, log_every=20, task_weights=task_weights, base=base, seed=seed,
                  filler_seed=filler_seed, loss=LossWeights(answer=answer_weight, answer_end=answer_end_weight),
                  hex_chars=hex_chars or adds_hex_chars, adds_hex_chars=adds_hex_chars, next_document=next_document)


def _tiny_v4_needles() -> Recipe:
    """Continues a `tiny-v4` model: the needle families at 4K-32K with the indexer's top-k and the
    experts' FP4 QAT throughout (the weights start on the FP4 grid they ship on), at a third of
    tiny-v4's peak learning rate."""
    return _continuation("tiny-v4-needles", [(500, 4096, 8), (1000, 8192, 4), (1300, 16384, 2), (1400, 32768, 1)],
                         _NEEDLE_FOCUS, base="tiny-v4", seed=1)


# what `tiny-v4-needles` still missed: UUID copies (found, then copied imprecisely) and the queried
# key among distractor needles; the solved families stay in the mix so that they are kept
_KEY_FOCUS = {"passkey": 0.05, "niah_single_1": 0.1, "niah_single_2": 0.1, "niah_single_3": 0.3,
              "niah_multikey_1": 0.3, "niah_multikey_2": 0.05, "niah_multikey_3": 0.05, "niah_multiquery": 0.05}


def _tiny_v4_keys() -> Recipe:
    """Continues a `tiny-v4-needles` model on UUID needles and multi-key needles at 4K-16K (the
    lengths of their quality bars), indexer top-k and experts' FP4 QAT throughout."""
    return _continuation("tiny-v4-keys", [(500, 4096, 8), (1000, 8192, 4), (1250, 16384, 2)], _KEY_FOCUS,
                         base="tiny-v4-needles", seed=2)


def _tiny_v4_hex_keys() -> Recipe:
    """Continues a `tiny-v4-hex` model straight on `tiny-v4-keys`' mix (UUID and multi-key needles
    weighted 0.3 each, the solved families kept) at 4K-16K, the lengths of the bars it targets; one
    H200 command together with the end of the base run."""
    return _continuation("tiny-v4-hex-keys", [(400, 4096, 8), (800, 8192, 4), (1000, 16384, 2)], _KEY_FOCUS,
                         base="tiny-v4-hex", seed=2, hex_chars=True)


_DISTRACTOR_FOCUS = {"passkey": 0.05, "niah_single_1": 0.1, "niah_single_2": 0.1, "niah_single_3": 0.3,
                     "niah_multikey_hard": 0.25, "niah_multikey_1": 0.1, "niah_multikey_2": 0.05,
                     "niah_multiquery": 0.05}


def _tiny_v4_distractors() -> Recipe:
    """Continues a `tiny-v4-keys` model where it missed its bars: it answered 23 of 80 multi-key
    prompts with a distractor needle's value and copied UUIDs with a few characters wrong. Multi-key
    needles whose distractor keys share a word with the asked key (the needle must be found by the
    whole key), and UUID needles from 2K tokens up, where an exact copy is easier to learn."""
    return _continuation("tiny-v4-distractors", [(300, 2048, 16), (700, 4096, 8), (1100, 8192, 4), (1300, 16384, 2)],
                         _DISTRACTOR_FOCUS, base="tiny-v4-keys", seed=4)


_COPY_FOCUS = {"niah_single_3": 0.4, "niah_multikey_1": 0.15, "niah_multikey_hard": 0.1, "passkey": 0.1,
               "niah_single_1": 0.1, "niah_single_2": 0.1, "niah_multiquery": 0.05}


def _tiny_v4_copy() -> Recipe:
    """Continues a `tiny-v4-keys` model on UUID copying where examples are cheap: one example per
    sequence, so 1K×32 gives sixteen times the UUID answers per step of 16K×2. The model finds UUID
    needles and then copies them with a few characters wrong (three continuations at 2K-16K did not
    move that); here most of the steps are at 1K-4K, then 8K and 16K keep the lengths of the bars."""
    return _continuation("tiny-v4-copy", [(400, 1024, 32), (700, 2048, 16), (1000, 4096, 8), (1200, 8192, 4),
                                          (1300, 16384, 2)], _COPY_FOCUS, base="tiny-v4-keys", seed=5)


def _tiny_v4_hex_copy() -> Recipe:
    """Continues a `tiny-v4-hex-keys` model on tiny-v4-copy's mix at 1K-4K only: with one character
    per token, its UUID copies still swap, drop or repeat single characters, inside the sliding window
    too; short sequences give many UUID answers per step. Trained once, stopped by device time at
    step 437: UUID needles 90 / 70 / 65 % at 4K / 8K / 16K (models/tiny-v4/README.md)."""
    return _continuation("tiny-v4-hex-copy", [(250, 1024, 32), (400, 2048, 16), (480, 4096, 8)], _COPY_FOCUS,
                         base="tiny-v4-hex-keys", seed=6, hex_chars=True)


_HEX_KEY_MATCH_FOCUS = {"niah_multikey_1": 0.35, "niah_multikey_hard": 0.15, "niah_single_3": 0.2, "passkey": 0.05,
                        "niah_single_1": 0.1, "niah_single_2": 0.1, "niah_multiquery": 0.05}


def _tiny_v4_hex_multikey() -> Recipe:
    """Continues a `tiny-v4-hex-copy` model, which copies UUIDs but answers multi-key needles at chance
    (one of four needles, 20-30 % from 512 tokens to 16K): multi-key needles at half the mix, with
    the short sequences that taught the copies (1K-2K, many answers per step), then 4K-16K to keep
    the lengths of the bars (not trained yet)."""
    return _continuation("tiny-v4-hex-multikey", [(300, 1024, 32), (500, 2048, 16), (700, 4096, 8), (900, 8192, 4),
                                                  (1000, 16384, 2)], _HEX_KEY_MATCH_FOCUS,
                         base="tiny-v4-hex-copy", seed=8, hex_chars=True)


_UUID_AND_KEYS_FOCUS = {"niah_single_3": 0.35, "niah_multikey_1": 0.25, "niah_multikey_hard": 0.1, "passkey": 0.05,
                        "niah_single_1": 0.1, "niah_single_2": 0.1, "niah_multiquery": 0.05}


def _tiny_v4_hexsplit() -> Recipe:
    """The shipped model's fourth stage. Continues a `tiny-v4-keys` model (multi-key needles 70 / 45 /
    55 % at 4K / 8K / 16K, UUIDs 15 / 25 / 45 %) with the hex rule added to its own tokenizer
    (`TaskTokenizer.with_hex_chars`): the vocabulary stays, every prompt without a UUID encodes as
    before, and the few letter merges inside UUIDs (`cc`, `bd`) become single letters, which the
    model already reads between the digits. The tiny-v4-hex chain fixed the copies on a new tokenizer but lost the key matching this
    model has; here the UUID and multi-key needles share the mix, 1K-2K first (many answers per
    step), then the lengths of the bars: UUIDs 60 / 65 / 75 %, multi-key needles 65 / 70 / 60 %
    (docs/eval-tiny-v4/hexsplit-model/README.md)."""
    return _continuation("tiny-v4-hexsplit", [(300, 1024, 32), (500, 2048, 16), (800, 4096, 8), (1000, 8192, 4),
                                              (1150, 16384, 2)], _UUID_AND_KEYS_FOCUS, base="tiny-v4-keys", seed=9,
                         adds_hex_chars=True)


def _tiny_v4_hexsplit_2() -> Recipe:
    """A second pass of `tiny-v4-hexsplit`'s mix on its export (fresh examples, data seed 10), with
    more of the steps at 1K-4K, where UUID and multi-key answers are cheap. Trained once, not
    shipped: at 16K it writes every multi-key value as a UUID-shaped string and runs most UUIDs on
    past their end (models/tiny-v4/README.md)."""
    return _continuation("tiny-v4-hexsplit-2", [(300, 1024, 32), (550, 2048, 16), (800, 4096, 8), (950, 8192, 4),
                                                (1050, 16384, 2)], _UUID_AND_KEYS_FOCUS, base="tiny-v4-hexsplit",
                         seed=10, hex_chars=True)


# hexsplit's lengths in the same proportions, 800 steps: (until step, length, batch)
_POLISH_SCHEDULE = [(200, 1024, 32), (350, 2048, 16), (550, 4096, 8), (700, 8192, 4), (800, 16384, 2)]


def _tiny_v4_polish() -> Recipe:
    """Continues a `tiny-v4-hexsplit` model on its mix with fresh examples (data seed 11) and the
    filler of that run (`filler_seed` 9). Every earlier continuation drew new filler sentences with
    its data seed: its language-model loss on them started near 3 and fell to 0.3-0.6, so most of its
    gradient went to learning the new filler by heart, the answers being a small part of the loss.
    Here the filler is known from the start (LM loss 0.63 at step 20), the answers' loss counts four
    times and the peak lr is half hexsplit's, so the steps go to the copies (UUIDs miscopied by a
    character or two) and to the key matching; hexsplit's lengths in the same proportions. UUIDs
    75 / 90 / 85 % at 4K / 8K / 16K, multi-key needles 65 / 70 / 65 %, but most UUIDs run on past
    their end (models/tiny-v4/README.md)."""
    return _continuation("tiny-v4-polish", _POLISH_SCHEDULE, _UUID_AND_KEYS_FOCUS, base="tiny-v4-hexsplit",
                         seed=11, hex_chars=True, filler_seed=9, answer_weight=4.0, lr=5e-4)


def _tiny_v4_stop() -> Recipe:
    """Continues a `tiny-v4-polish` model (the shipped one) on the same mix, filler and answer
    weight, with fresh examples (data seed 12), the answers' closing tokens (the period after the
    value, then EOS) weighted four times more again and a lower peak lr (3e-4). Polish finds and
    copies UUIDs, but 40 of its 50 right ones at 4K-16K run on in hex characters past their end:
    the answer loss, an average over some 40 answer tokens, gives the one token that stops a UUID
    little weight. Teacher-forced on the 20 evaluation prompts at 4K with the right UUID, polish
    puts the period after it in 13; in the other 7 it repeats the UUID's last character with
    probability 0.55-1.0, and greedy decoding through the engine gives the same tokens (3 prompts
    compared). Trained once (not shipped): its `answer_end_acc` was 1.00 at every logged step, and
    at 8K it wrote 6 of 20 UUIDs alone against polish's 2 (RULER scoring 90 % for both) — the
    closing tokens were never the trouble in training; where the answer ends was
    (`tiny-v4-anypos`)."""
    return _continuation("tiny-v4-stop", _POLISH_SCHEDULE, _UUID_AND_KEYS_FOCUS, base="tiny-v4-polish",
                         seed=12, hex_chars=True, filler_seed=9, answer_weight=4.0, answer_end_weight=4.0, lr=3e-4)



def _tiny_v4_anypos() -> Recipe:
    """Continues a `tiny-v4-polish` model (the shipped one) on its mix, filler and answer weight with
    fresh examples (data seed 13), each row going on after its answer's EOS with the start of a next
    document of 0-127 tokens. Every earlier recipe ended each answer at its row's end, and rows are
    multiples of 128 tokens: an answer's last token always sat at the same place in its HCA block
    (and CSA block), and the models learned to copy and stop by that place. Teacher-forced on 10
    UUID prompts at 4K, polish copies 8 whole and stops after all 10 when the answer ends where it
    trained to; with the prompt one token longer it copies none whole, two or four tokens shorter it
    stops after none, 128 shorter it copies and stops again (`python -m hybridkv.train.answer_phase`;
    `tiny-v4-stop` trained on the answer's end and did not change this)."""
    return _continuation("tiny-v4-anypos", _POLISH_SCHEDULE, _UUID_AND_KEYS_FOCUS, base="tiny-v4-polish",
                         seed=13, hex_chars=True, filler_seed=9, answer_weight=4.0, lr=5e-4, next_document=128)

# anypos' schedule gave 16K rows 100 of its 800 steps; this one gives them 300 of 700
_LONG_SCHEDULE = [(100, 2048, 16), (250, 4096, 8), (400, 8192, 4), (700, 16384, 2)]


def _tiny_v4_long() -> Recipe:
    """Continues a `tiny-v4-anypos` model on its mix, filler, answer weight and next documents, with
    fresh examples (data seed 14) and three times the 16K steps. Anypos copies UUIDs whole at 85 / 90
    / 85 % at 4K / 8K / 16K; the misses are one or two characters replaced or swapped, and a CSA
    entry holds four tokens, so the copy must read each character back out of a compressed entry
    (or of the window). Its 16K rows were 100 steps of 2: some 70 UUID answers at that length.
    Trained once with this lr and once with 5e-4: UUIDs at 16K 90 and 85 %, and the first gave up
    multi-key needles at 8K (75 -> 65 %; docs/eval-tiny-v4/long-runs/)."""
    return _continuation("tiny-v4-long", _LONG_SCHEDULE, _UUID_AND_KEYS_FOCUS, base="tiny-v4-anypos",
                         seed=14, hex_chars=True, filler_seed=9, answer_weight=4.0, lr=3e-4, next_document=128)


TINY_V41_MODEL = {
    **{k: v for k, v in TINY_V4_MODEL.items() if k not in ("num_hash_layers", "num_nextn_predict_layers")},
    "model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"],
    # seven blocks like tiny-v4's six + MTP: a window layer, then Full (ratio 2) / Reuse, Full (ratio 1) /
    # Reuse / Reindex (inside the candidate pool of 64 blocks of 8) / Reuse
    "num_hidden_layers": 7, "num_nextn_predict_layers": 0, "num_hash_layers": 0,
    "compress_ratios": [0, 2, 2, 1, 1, 1, 1], "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 3, 5],
    "candidate_source_layer_id": 3, "candidate_topk_blocks": 64, "candidate_block_size": 8,
}


def _tiny_v41() -> Recipe:
    """tiny-v4's data and curriculum on a DeepSeek-V4.1 model of about the same size (10.2M vs
    11.0M parameters): the V4 vs V4.1 comparison. The training forward computes CSA logits densely,
    and ratio-1 layers have an entry per token, so its longest stage is 16K×1."""
    r = _tiny_v4()
    stages = [st for st in r.stages if st.seq_len <= 8192]
    stages += [Stage(2650, 16384, 1, dense_indexer=False), Stage(2750, 16384, 1, dense_indexer=False,
                                                                  qat_experts=True)]
    return Recipe(name="tiny-v41", model=TINY_V41_MODEL, vocab_size=r.vocab_size,
                  tokenizer_texts=r.tokenizer_texts, steps=r.steps, stages=stages, lr=r.lr, warmup=r.warmup,
                  log_every=r.log_every, task_weights=r.task_weights)


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
    "tiny-v4": _tiny_v4, "tiny-v4-needles": _tiny_v4_needles, "tiny-v4-keys": _tiny_v4_keys,
    "tiny-v4-hexsplit": _tiny_v4_hexsplit, "tiny-v4-hexsplit-2": _tiny_v4_hexsplit_2,
    "tiny-v4-polish": _tiny_v4_polish,
    "tiny-v4-stop": _tiny_v4_stop, "tiny-v4-anypos": _tiny_v4_anypos, "tiny-v4-long": _tiny_v4_long,
    "tiny-v4-distractors": _tiny_v4_distractors, "tiny-v4-copy": _tiny_v4_copy,
    "tiny-v4-hex": _tiny_v4_hex, "tiny-v4-hex-keys": _tiny_v4_hex_keys, "tiny-v4-hex-copy": _tiny_v4_hex_copy,
    "tiny-v4-hex-multikey": _tiny_v4_hex_multikey,
    "tiny-v41": _tiny_v41, "tiny-v4-r1": _tiny_v4_r1, "smoke": _smoke, "smoke-v41": _smoke_v41,
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise TrainingError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]()
