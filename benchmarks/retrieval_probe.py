"""Can a recipe's architecture learn one retrieval task at all? Trains the recipe's model from
scratch on a single task at one length (every CSA entry visible: the DSA warm-up view) and prints
the answer loss and teacher-forced exact match as it goes. A diagnostic for the training recipe,
not part of it.

    python benchmarks/retrieval_probe.py --recipe tiny-v4 --task passkey --length 1024 --batch 32 \
        --steps 1500 --device cuda --max-minutes 5
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace

from hybridkv.train.loop import train
from hybridkv.train.recipes import Stage, get_recipe


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="tiny-v4")
    p.add_argument("--task", default="passkey")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-minutes", type=float, default=5)
    p.add_argument("--tokenizer-dir", default=None, help="reuse this run directory's tokenizer.json")
    a = p.parse_args()
    recipe = get_recipe(a.recipe)
    recipe = replace(recipe, name=f"probe-{a.task}-{a.length}", steps=a.steps, warmup=50,
                     stages=[Stage(a.steps, a.length, a.batch, dense_indexer=True)], task_weights={a.task: 1.0},
                     lr=a.lr or recipe.lr, log_every=25)
    with tempfile.TemporaryDirectory() as run:
        if a.tokenizer_dir:
            import shutil
            shutil.copy(f"{a.tokenizer_dir}/tokenizer.json", f"{run}/tokenizer.json")
        train(recipe, run, a.device, a.max_minutes)


if __name__ == "__main__":
    main()
