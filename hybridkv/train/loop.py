"""The training loop: recipe → tokenizer, model, optimizers; steps with bf16 autocast on CUDA,
gradient clipping, the aux-loss-free bias update, logs (JSON lines + a loss-curve PNG), and a
checkpoint with optimizer state that a later command resumes (`max_minutes` bounds one command).

Run directory (`rundir` owns its tokenizer, config and state files):
    tokenizer.json, config.json, state.pt, state-portable.pt.NN
    log.jsonl         one line per logged step;  loss.png  the curves
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from hybridkv.config import ModelConfig
from hybridkv.errors import TrainingError
from hybridkv.model import Transformer
from hybridkv.train.data import TaskBatches
from hybridkv.train.export import float_model
from hybridkv.train.forward import TrainOptions, train_forward
from hybridkv.train.init import init_weights
from hybridkv.train.losses import compute_losses, update_gate_biases
from hybridkv.train.optim import build_optimizers, lr_schedule
from hybridkv.train.recipes import Recipe
from hybridkv.train.rundir import PORTABLE, load_portable, mismatch, model_config, prepare_tokenizer, save_portable


class _Clip:
    """Gradient clipping: one norm over every parameter, or with `recipe.indexer_clip` the indexers'
    apart from the rest (the split made once). Called after backward, it returns the model's norm
    before clipping and logs the indexers' when they are apart."""

    def __init__(self, model: torch.nn.Module, recipe: Recipe):
        self.clip, self.indexer_clip = recipe.clip, recipe.indexer_clip
        if self.indexer_clip is None:
            self.rest, self.indexer = list(model.parameters()), []
        else:
            named = list(model.named_parameters())
            self.indexer = [p for name, p in named if ".indexer." in name]
            self.rest = [p for name, p in named if ".indexer." not in name]

    def __call__(self, logs: dict) -> torch.Tensor:
        if self.indexer:
            logs["indexer_grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.indexer, self.indexer_clip))
        return torch.nn.utils.clip_grad_norm_(self.rest, self.clip)


def freeze_all_but(model: torch.nn.Module, prefix: str) -> set[str]:
    """Only the parameters named with `prefix` train (a recipe's `trains`); returns their names."""
    names = set()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(prefix))
        if name.startswith(prefix):
            names.add(name)
    if not names:
        raise TrainingError(f"no parameter of this model is named {prefix}*: nothing would train")
    return names


def _rewarm_steps(recipe: Recipe) -> int:
    """Steps of the linear lr re-warm-up after resuming without optimizer moments."""
    return max(1, recipe.warmup // 5)


def _set_lr(optimizers, lr: float) -> None:
    for opt in optimizers:
        for g in opt.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)


def save_state(path: Path, model, optimizers, progress: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizers": [o.state_dict() for o in optimizers],
                "progress": progress}, tmp)
    tmp.replace(path)


def plot_log(log_path: Path, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    if not rows:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r["step"] for r in rows]
    for key in ("lm", "answer", "answer_end", "mtp0", "mtp1", "indexer_kl"):
        if key in rows[0]:
            axes[0].plot(steps, [r.get(key, math.nan) for r in rows], label=key)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("step")
    axes[0].legend()
    axes[0].set_title("losses")
    axes[1].plot(steps, [r["answer_exact"] for r in rows], label="whole answer")
    if "answer_end_acc" in rows[0]:
        axes[1].plot(steps, [r.get("answer_end_acc", math.nan) for r in rows], label="closing tokens")
    axes[1].legend()
    axes[1].set_title("answer match (teacher forced)")
    axes[1].set_xlabel("step")
    axes[2].plot(steps, [r["seq_len"] for r in rows], label="seq_len")
    axes[2].set_title("length curriculum")
    axes[2].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _comparable(config: ModelConfig) -> dict:
    d = config.to_dict()
    for k in ("expert_dtype", "quantization_config", "torch_dtype"):
        d.pop(k, None)
    return d


def load_base_model(model, init_from: Path) -> str:
    """Load a release-format model directory (what `--export` wrote, checked by `_take_base`) into
    the training model. Returns the checkpoint's identity."""
    from hybridkv.weights import checkpoint_identity
    model.load_state_dict(float_model(init_from).state_dict())
    return checkpoint_identity(init_from)


def _take_base(recipe: Recipe, init_from: Path, run_dir: Path) -> None:
    """A continued model keeps its tokenizer: copy it into the run (or check the run's is the same),
    once the model is known to be the recipe's architecture and its tokenizer to follow the recipe's
    rule. Nothing is written when a check fails."""
    from hybridkv.tasks.tokenizer import TaskTokenizer
    src, dst = init_from / "tokenizer.json", run_dir / "tokenizer.json"
    if not src.exists():
        raise TrainingError(f"--init-from {init_from}: no tokenizer.json (a continued model keeps its tokenizer)")
    base = TaskTokenizer.load(src)
    base_has = recipe.hex_chars and not recipe.adds_hex_chars    # the rule the base's tokenizer must have
    if base.hex_chars != base_has:
        want, got = ("does", "does not") if base_has else ("does not", "does")
        raise TrainingError(f"--init-from {init_from}: recipe {recipe.name!r} continues a model whose tokenizer {want} "
                            f"keep hex characters apart (hex_chars), and this model's tokenizer {got}")
    theirs, ours = _comparable(ModelConfig.from_json(init_from)), _comparable(model_config(recipe, base.vocab_size))
    if theirs != ours:
        diff = sorted(k for k in {**theirs, **ours} if theirs.get(k) != ours.get(k))
        raise TrainingError(f"--init-from {init_from}: its config differs from the recipe's model in {', '.join(diff)}")
    # the base's file as it is, or its tokenizer with the hex rule added (the vocabulary kept)
    data = base.with_hex_chars().tokenizer.to_str(pretty=True).encode() if recipe.adds_hex_chars else src.read_bytes()
    if not dst.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
    elif dst.read_bytes() != data:
        raise TrainingError(f"{dst} differs from {src}{' with the hex rule added' if recipe.adds_hex_chars else ''}: "
                            f"a continued model must keep its tokenizer")


def _check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise TrainingError(f"--device {device}: not a device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainingError(f"--device {device}: this machine has no CUDA device (use --device cpu)")


def train(recipe: Recipe, run_dir: str | Path, device: str = "cpu", max_minutes: float | None = None,
          resume: bool = False, echo=print, stop_at_step: int | None = None,
          init_from: str | Path | None = None, portable_dir: str | Path | None = None) -> dict:
    """Run (or continue) `recipe` in run_dir, until its last step, `max_minutes` or `stop_at_step`;
    returns the progress dict. A fresh run of a recipe with a `base` starts from `init_from`, a model
    directory exported from a run of that base recipe. With `portable_dir`, every checkpoint (every
    5 minutes and the last) also writes the portable state there, so that a command killed from
    outside still leaves its last checkpoint for a fresh machine (a run already complete writes its
    state there once)."""
    run_dir = Path(run_dir)
    _check_device(device)
    if max_minutes is not None and not max_minutes > 0:
        raise TrainingError(f"--max-minutes {max_minutes}: must be positive")
    if recipe.base and not resume and init_from is None:
        raise TrainingError(f"recipe {recipe.name!r} continues a {recipe.base!r} model: pass --init-from MODEL_DIR")
    if init_from is not None and not recipe.base:
        raise TrainingError(f"recipe {recipe.name!r} trains from scratch; --init-from is for recipes that continue one")
    if init_from is not None and not resume and not (Path(init_from) / "config.json").is_file():
        raise TrainingError(f"--init-from {init_from}: not a model directory (no config.json); pass a directory "
                            f"that --export wrote")
    state_path = run_dir / "state.pt"
    if resume and not state_path.exists() and not any(run_dir.glob(f"{PORTABLE}.*")):
        raise TrainingError(f"--resume: no {state_path.name} or {PORTABLE}.* in {run_dir}: nothing to continue "
                            f"(--out names the run's directory)")
    if init_from is not None and not resume:
        _take_base(recipe, Path(init_from), run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    torch.manual_seed(recipe.seed)
    tok = prepare_tokenizer(recipe, run_dir)
    config = model_config(recipe, tok.vocab_size)
    with torch.device(device):
        model = Transformer(config, dtype=torch.float32)
    init_weights(model, recipe.seed)
    base_identity = None
    if init_from is not None and not resume:
        base_identity = load_base_model(model, Path(init_from))
    if recipe.trains is not None:
        freeze_all_but(model, recipe.trains)
    # no main layer trains (a recipe that trains only the MTP block): the forward runs them without gradients
    trunk_frozen = not any(p.requires_grad for layer in model.layers for p in layer.parameters())
    # the selection bias moves by the balance rule only, and only in the layers that train
    balanced = [layer for layer in [*model.layers, *model.mtp]
                if any(p.requires_grad for p in layer.parameters())]
    for layer in [*model.layers, *model.mtp]:
        if layer.ffn.gate.bias is not None:
            layer.ffn.gate.bias.requires_grad_(False)
    optimizers = build_optimizers(model, recipe.lr)
    clip = _Clip(model, recipe)
    progress = {"step": 0, "tokens": 0, "seconds": 0.0, "commands": 0, "seed": recipe.seed}
    if base_identity is not None:
        progress["init_from"] = {"path": Path(init_from).name, "identity": base_identity}
    log_path = run_dir / "log.jsonl"
    rewarm_until = 0
    if resume:
        state = (torch.load(state_path, map_location=device, weights_only=False) if state_path.exists()
                 else load_portable(run_dir, device))
        try:
            model.load_state_dict(state["model"])
        except RuntimeError as e:   # missing, unexpected or other-shaped tensors
            raise TrainingError(f"--resume: the state in {run_dir} is not a {recipe.name!r} model "
                                f"({mismatch(e)}); resume it with the recipe it was trained with") from None
        for opt, sd in zip(optimizers, state.get("optimizers", [])):
            opt.load_state_dict(sd)
        progress = state["progress"]
        if progress.get("seed", recipe.seed) != recipe.seed:   # a resumed run must draw the same stream
            raise TrainingError(f"this run draws its data with seed {progress['seed']}, not {recipe.seed}: "
                                f"resume it with --seed {progress['seed']}")
        if "optimizers" not in state:  # fresh moments: warm the learning rate up again
            rewarm_until = progress["step"] + _rewarm_steps(recipe)
        echo(f"resumed at step {progress['step']} ({progress['tokens'] / 1e6:.1f}M tokens"
             f"{'' if 'optimizers' in state else ', optimizer moments restarted'})")
    elif log_path.exists():
        log_path.unlink()
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    progress["commands"] += 1
    model.train()
    data = TaskBatches(tok, recipe.seed, recipe.pool_seed, recipe.next_document)
    gen = torch.Generator(device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else None
    deadline = t_start + max_minutes * 60 if max_minutes else None
    n_params = sum(p.numel() for p in model.parameters())
    echo(f"{recipe.name}: {n_params / 1e6:.2f}M parameters, {recipe.steps} steps, "
         f"{recipe.tokens() / 1e6:.0f}M tokens, vocab {tok.vocab_size}, device {device}")
    last_save = time.perf_counter()
    portable_saved = False
    window_t, window_tokens = time.perf_counter(), 0
    with open(log_path, "a") as log:
        while progress["step"] < recipe.steps:
            step = progress["step"]
            gen.manual_seed(recipe.seed * 1_000_003 + step)   # per step, so a resumed run draws the same
            st = recipe.stage(step)
            nxt = recipe.stage(step + 1)
            ids, sup = data.get(step, st.batch, st.seq_len, recipe.task_mix(step),
                                (nxt.batch, nxt.seq_len, recipe.task_mix(step + 1)))
            ids, sup = ids.to(device, non_blocking=True), sup.to(device, non_blocking=True)
            lr = lr_schedule(step, recipe.steps, recipe.warmup, recipe.lr, recipe.final_lr_frac)
            if step < rewarm_until:
                lr *= (step + 1 - (rewarm_until - _rewarm_steps(recipe))) / _rewarm_steps(recipe)
            _set_lr(optimizers, lr)
            opts = TrainOptions(dense_indexer=st.dense_indexer, qat_experts=st.qat_experts, qat_indexer=True,
                                kl_queries=recipe.kl_queries,
                                reuse_layers_train_indexer=recipe.reuse_layers_train_indexer,
                                mtp_chain=recipe.mtp_chain, frozen_trunk=trunk_frozen)
            if autocast is not None:
                with autocast:
                    out = train_forward(model, ids, opts, gen)
                    loss, logs = compute_losses(model, ids, sup, out, recipe.loss)
            else:
                out = train_forward(model, ids, opts, gen)
                loss, logs = compute_losses(model, ids, sup, out, recipe.loss)
            loss.backward()
            grad_norm = clip(logs)
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
            logs.update(update_gate_biases(model, out.aux.expert_counts, recipe.bias_rate, balanced))
            progress["step"] += 1
            progress["tokens"] += ids.numel()
            window_tokens += ids.numel()
            if progress["step"] % recipe.log_every == 0 or progress["step"] == recipe.steps:
                now = time.perf_counter()
                logs.update(step=progress["step"], lr=lr, seq_len=st.seq_len, batch=st.batch,
                            grad_norm=float(grad_norm), tokens=progress["tokens"],
                            tok_per_s=window_tokens / max(now - window_t, 1e-9),
                            dense_indexer=st.dense_indexer, qat_experts=st.qat_experts)
                window_t, window_tokens = now, 0
                log.write(json.dumps(logs) + "\n")
                log.flush()
                echo(f"step {logs['step']:5d}  len {st.seq_len:5d}  loss {logs['loss']:.3f}  lm {logs['lm']:.3f}  "
                     f"answer {logs['answer']:.3f}  exact {logs['answer_exact']:.2f}  end {logs['answer_end_acc']:.2f}  "
                     f"kl {logs.get('indexer_kl', 0):.3f}  load {logs['expert_max_over_mean']:.2f}  "
                     + "".join(f"{k} {logs[k]:.3f}  " for k in ("mtp0", "mtp1") if k in logs) +
                     f"lr {lr:.2e}  {logs['tok_per_s'] / 1e3:.0f}K tok/s")
            out_of_time = ((deadline is not None and time.perf_counter() > deadline)
                           or (stop_at_step is not None and progress["step"] >= stop_at_step))
            if out_of_time or time.perf_counter() - last_save > 300 or progress["step"] == recipe.steps:
                progress["seconds"] += time.perf_counter() - t_start
                t_start = time.perf_counter()
                save_state(state_path, model, optimizers, progress)
                if portable_dir is not None:
                    save_portable(model.state_dict(), progress, Path(portable_dir))
                    portable_saved = True
                last_save = time.perf_counter()
            if out_of_time:
                echo(f"stopping at step {progress['step']}; continue with --resume")
                break
    data.close()
    if portable_dir is not None and not portable_saved:   # the run was complete: nothing trained
        save_portable(model.state_dict(), progress, Path(portable_dir))
    plot_log(log_path, run_dir / "loss.png")
    return progress
