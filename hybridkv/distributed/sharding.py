"""Which part of each weight a rank holds, and where in the checkpoint that part lies.

The layout (README, "Several GPUs"), with `reduce="sum"`: attention heads split over the ranks (whole `o_groups` per
rank where the groups divide evenly, so the grouped output projection `wo_a` is local and `wo_b`
splits by its input; else heads within a group, with `wo_a`'s partial outputs summed across ranks
before a replicated `wo_b`); the single shared KV head, its compressors, the indexer, mHC, norms
and gate replicated, so every rank holds the same KV cache; routed experts split whole over the
ranks (expert parallel) or each expert's intermediate width split (`experts="tp"`); the shared
expert split by its intermediate width where its quantisation blocks allow, else held whole by
rank 0; embedding and head split by vocabulary. With `reduce="ordered"` (bit-equal to one
process) only the routed experts and the embedding are split; attention, the shared expert and the
head are whole on every rank.

A sharded module records `shard_slices`: for each parameter (its name inside the module), the
(dim, start, stop) ranges of the checkpoint tensor it holds. `checkpoint_slices` collects them,
with the checkpoint names of a rank's experts (their global index), for the loader.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hybridkv.config import ModelConfig
from hybridkv.distributed.group import Parallel
from hybridkv.errors import ConfigError

Slices = tuple[tuple[int, int, int], ...]      # (dim, start, stop) for each sliced dim


@dataclass(frozen=True)
class AttentionShard:
    heads: tuple[int, int]     # this rank's global heads [start, stop)
    groups: int                # output groups in this rank's wo_a
    group: int | None          # by heads: the one global group this rank's heads belong to
    by_group: bool             # whole groups per rank: wo_b split by input, its outputs summed


def attention_shard(c: ModelConfig, par: Parallel, fmt: str) -> AttentionShard:
    h, g, w = c.num_attention_heads, c.o_groups, par.world
    if par.single or par.ordered:   # ordered: attention whole on every rank
        return AttentionShard((0, h), g, None, True)
    hpg = h // g
    if g % w == 0:
        g0, g1 = par.part(g, "o_groups")
        shard = AttentionShard((g0 * hpg, g1 * hpg), g1 - g0, None, True)
    elif w % g == 0 and hpg % (w // g) == 0:
        per_group = w // g
        n = hpg // per_group
        grp, j = divmod(par.rank, per_group)
        start = grp * hpg + j * n
        shard = AttentionShard((start, start + n), 1, grp, False)
    else:
        raise ConfigError(f"{h} attention heads in {g} output groups cannot be split over {w} ranks: the "
                          f"world size must divide the groups, or be a multiple of them that divides the heads")
    if fmt == "fp8":
        rows = (shard.heads[1] - shard.heads[0]) * c.head_dim
        cols = shard.groups * c.o_lora_rank
        if rows % c.fp8_block[0] or (shard.by_group and cols % c.fp8_block[1]):
            raise ConfigError(f"attention split over {w} ranks: {rows} query rows / {cols} output columns per rank "
                              f"do not align with the FP8 scale blocks {tuple(c.fp8_block)}")
    return shard


def expert_range(c: ModelConfig, par: Parallel) -> tuple[int, int]:
    """The routed experts this rank holds whole (all of them unless expert parallel)."""
    if par.single or par.experts != "ep":
        return 0, c.n_routed_experts
    return par.part(c.n_routed_experts, "routed experts")


def _inter_split_ok(inter: int, par: Parallel, fmt: str, block: tuple[int, int]) -> bool:
    if inter % par.world:
        return False
    part = inter // par.world
    if fmt == "fp8":
        return part % block[0] == 0 and part % block[1] == 0
    if fmt == "fp4":          # rows any size; w2's input: e8m0 per 32 and the activation blocks
        return part % 32 == 0 and part % block[1] == 0
    return True


def expert_inter_part(c: ModelConfig, par: Parallel, fmt: str) -> tuple[int, int]:
    """Expert tensor parallel (`experts="tp"`): this rank's slice of every routed expert's
    intermediate width."""
    if par.single or par.experts != "tp":
        return 0, c.moe_intermediate_size
    if not _inter_split_ok(c.moe_intermediate_size, par, fmt, tuple(c.fp8_block)):
        raise ConfigError(f"routed experts of width {c.moe_intermediate_size} ({fmt}) cannot be split over "
                          f"{par.world} ranks along their quantisation blocks; use expert parallelism")
    return par.part(c.moe_intermediate_size, "expert intermediate width")


def shared_expert_part(c: ModelConfig, par: Parallel, fmt: str) -> tuple[int, int] | None:
    """This rank's slice of the shared expert's intermediate width; the whole width on rank 0 and
    None elsewhere where the width cannot split along its quantisation blocks."""
    inter = c.moe_intermediate_size
    if par.single or par.ordered:     # ordered: whole on every rank, added after the routed sum
        return 0, inter
    if _inter_split_ok(inter, par, fmt, tuple(c.fp8_block)):
        return par.part(inter, "shared expert width")
    return (0, inter) if par.rank == 0 else None


def vocab_part(vocab: int, par: Parallel, head: bool = False) -> tuple[int, int, int]:
    """(start, stop, chunk): this rank's rows of the embedding (or of the head: whole on every rank
    in ordered mode); chunk = ceil(vocab / world), the last rank's range may be shorter."""
    if head and par.ordered:
        return 0, vocab, vocab
    chunk = -(-vocab // par.world)
    start = min(vocab, par.rank * chunk)
    return start, min(vocab, start + chunk), chunk


def record(module: nn.Module, name: str, *slices: tuple[int, int, int]) -> None:
    """Note that `module`'s parameter `name` holds these (dim, start, stop) ranges of its checkpoint
    tensor (ranges covering a whole dim are left out)."""
    if not hasattr(module, "shard_slices"):
        module.shard_slices = {}
    module.shard_slices[name] = tuple(slices)


def record_linear(lin: nn.Module, dim: int, start: int, stop: int) -> None:
    """A `Linear` holds rows (dim 0) or input columns (dim 1) [start, stop) of its checkpoint
    weight: record the weight's and its scales' ranges for its format."""
    if lin.fmt == "fp4" and dim == 1:
        weight, scale = (start // 2, stop // 2), (start // 32, stop // 32)
    elif lin.fmt == "fp8":
        b = lin.block[dim]
        weight, scale = (start, stop), (start // b, -(-stop // b))
    else:
        weight, scale = (start, stop), (start, stop)
    record(lin, "weight", (dim, *weight))
    if lin.scale is not None:
        record(lin, "scale", (dim, *scale))


def checkpoint_slices(model: nn.Module) -> dict[str, tuple[str, Slices]]:
    """Every parameter or buffer a rank loads -> (its name in the checkpoint, the ranges it holds;
    empty: the whole tensor). Experts are renamed to their global index (`MoE.expert_offset`)."""
    renames: list[tuple[str, int]] = []
    sliced: dict[str, Slices] = {}
    for prefix, mod in model.named_modules():
        off = getattr(mod, "expert_offset", 0)
        if off:
            renames.append((f"{prefix}.experts.", off))
        for name, slices in getattr(mod, "shard_slices", {}).items():
            sliced[f"{prefix}.{name}" if prefix else name] = slices
    out = {}
    for name in model.state_dict():
        ckpt = name
        for head, off in renames:
            if name.startswith(head):
                idx, rest = name[len(head):].split(".", 1)
                ckpt = f"{head}{int(idx) + off}.{rest}"
        out[name] = (ckpt, sliced.get(name, ()))
    return out
