"""Does a model's answer depend on where in the compression blocks it falls? Teacher-forced on task
prompts with the reference completion after them, for prompts `shift` tokens shorter than
`--length`: how many answers the model would copy whole (every completion token its argmax) and
how many it would close (the period and EOS after the value its argmax).

    python -m hybridkv.train.answer_phase MODEL_DIR [--task niah_single_3] [--length 4096]
        [--samples 10] [--shifts 0,38,39,41,43,167]

A model trained on rows whose answers all end at the row's end (a multiple of 128 tokens) can
learn that place instead of the answer: shift = the completion's length reproduces it, the
other shifts move the answer within the HCA (128) and CSA (4) blocks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybridkv.errors import TrainingError, reports_errors
from hybridkv.train.export import float_model
from hybridkv.train.forward import TrainOptions, train_forward
from hybridkv.train.losses import CLOSING_TOKENS


@torch.no_grad()
def answer_checks(model, prompt: list[int], completion: list[int]) -> tuple[bool, bool]:
    """(whole, closed): teacher-forced, is every completion token the model's argmax, and are its
    last `CLOSING_TOKENS`?"""
    ids = torch.tensor([prompt + completion])
    out = train_forward(model, ids, TrainOptions(dense_indexer=False, qat_experts=True, qat_indexer=True))
    logits = model.logits(out.stream).view(1, ids.shape[1], -1)[0]
    n = len(completion)
    right = logits[-n - 1:-1].argmax(-1) == ids[0, -n:]
    return bool(right.all()), bool(right[-CLOSING_TOKENS:].all())


@reports_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybridkv.train.answer_phase")
    p.add_argument("model_dir")
    p.add_argument("--task", default="niah_single_3")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--shifts", default="0,38,39,41,43,167", help="prompts this many tokens shorter than --length")
    p.add_argument("--seed", type=int, default=0, help="the filler pool's seed (the evaluation's by default)")
    a = p.parse_args(argv)
    from hybridkv.tasks.generators import Pools, make_sample
    from hybridkv.tasks.tokenizer import TaskTokenizer
    try:
        shifts = [int(x) for x in a.shifts.split(",")]
    except ValueError:
        raise TrainingError(f"--shifts takes comma-separated integers, got {a.shifts!r}") from None
    if any(s < 0 or s >= a.length for s in shifts):
        raise TrainingError(f"--shifts must lie in [0, {a.length})")
    if a.samples < 1:
        raise TrainingError("--samples must be at least 1")
    if not (Path(a.model_dir) / "tokenizer.json").is_file():
        raise TrainingError(f"{a.model_dir}: no tokenizer.json (a model directory that --export wrote)")
    model = float_model(a.model_dir).eval()
    block = max(model.config.compress_ratios)   # the largest compression block (HCA's)
    pools = Pools(TaskTokenizer.load(a.model_dir), seed=a.seed)
    print(f"{a.task}, {a.samples} prompts of {a.length} - shift tokens, teacher-forced")
    print(f"| shift | answer's last token, offset in its {block}-block | copied whole | closed |")
    print("|---:|---:|---:|---:|")
    for shift in shifts:
        whole = closed = 0
        offsets = set()
        for i in range(a.samples):
            try:
                s = make_sample(a.task, i, pools, a.length - shift, (i + 0.5) / a.samples)
            except ValueError as e:     # an unknown task, or a prompt too short for it
                raise TrainingError(f"--task {a.task} at {a.length - shift} tokens: {e}") from None
            w, c = answer_checks(model, s.prompt, s.completion)
            whole, closed = whole + w, closed + c
            offsets.add((len(s.prompt) + len(s.completion) - 1) % block)
        at = ", ".join(str(o) for o in sorted(offsets))
        print(f"| {shift} | {at} | {whole}/{a.samples} | {closed}/{a.samples} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
