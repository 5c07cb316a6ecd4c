"""A request inside the engine: its tokens, progress, cache placement and outputs."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from hybridkv.cache.paged import SeqCache
from hybridkv.cache.prefix import Snapshot
from hybridkv.engine.detokenize import OutputText
from hybridkv.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    root: bytes                                   # prefix-hash root (model identity + cache salt)
    arrival: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0                          # positions whose KV is in the cache
    cache: SeqCache | None = None
    block_hashes: list[bytes] = field(default_factory=list)   # hashes of this request's complete blocks
    num_cached_tokens: int = 0                     # prompt tokens served from the prefix cache
    num_replayed_tokens: int = 0                   # tokens recomputed by bounded replay
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""                                 # released so far (engine/detokenize.py); final once finished
    decoded: OutputText = field(default_factory=OutputText)   # the output's decode, kept incrementally
    finish_reason: str | None = None
    error: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None       # seeded requests: on the device the engine samples on
    generator_device: str = "cpu"
    pending_snapshots: dict[int, dict[int, list[torch.Tensor]]] = field(default_factory=dict)
    step_logits: list[torch.Tensor] = field(default_factory=list)   # only when the engine records them
    capture: object | None = None                  # attention mass recorded at the prompt's end (oracle policies)
    device_kv_bytes: dict[str, int] | None = None  # device KV this request held when it finished, by kind
    new_snapshots: list[tuple[int, Snapshot]] = field(default_factory=list)
    rolling_snapshot: tuple[int, Snapshot] | None = None
    snapshots_below: list[tuple[int, Snapshot, object]] = field(default_factory=list)   # for the lower tiers alone
    draft: object | None = None                    # speculative: the next step's draft (speculative.Draft)
    mtp_start: int | None = None                   # speculative: first position of the MTP window computed
    spec_steps: int = 0                            # speculative verify steps, draft tokens, accepted drafts
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if self.params.seed is not None:
            # torch samples on a tensor's device only with a generator of that device
            self.generator = torch.Generator(device=self.generator_device).manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_tokens - 1

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    def reset_for_recompute(self) -> None:
        """After preemption: everything computed is dropped; prompt + output so far are recomputed."""
        self.status = Status.WAITING
        self.num_computed = 0
        self.cache = None
        self.block_hashes = []
        self.pending_snapshots = {}
        self.new_snapshots = []
        self.snapshots_below = []
        self.rolling_snapshot = None
        self.draft = None
        self.mtp_start = None
        self.num_preemptions += 1
