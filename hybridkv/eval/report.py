"""Results a person compares: a markdown table per run, PNG plots next to the JSON (accuracy vs
length per task, device-resident KV bytes vs length per policy, depth × length heatmaps for the
needle tasks), and a side-by-side comparison of two runs."""

from __future__ import annotations

import json
from pathlib import Path

from hybridkv.eval.runner import EvalRun
from hybridkv.eval.tasks import NEEDLE_TASKS


def _fmt_len(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _kib(b: float | None) -> str:
    return "-" if b is None else f"{b / 1024:,.1f}"


# the needle tasks rescored from the stored outputs, stricter than RULER's substring match
_STRICTER = (
    ("whole-word match (`word_match_all`: the value itself, not the start of a longer one)", EvalRun.word_accuracy),
    ("first-answer match (`leading_match_all`: the value is the output's first word, so a list of several "
     "needles' values counts only when it starts with the asked one)", EvalRun.leading_accuracy),
)


def markdown(runs: list[EvalRun]) -> str:
    """One accuracy table per policy, then device KV per policy and length."""
    out = []
    for run in runs:
        lengths = run.lengths
        out.append(f"### policy `{run.policy}` ({run.samples} samples per cell, {run.seconds:.0f} s)\n")
        out.append("| task | " + " | ".join(_fmt_len(n) for n in lengths) + " |")
        out.append("|---|" + "---|" * len(lengths))
        for task in run.tasks:
            cells = [run.accuracy(task, n) for n in lengths]
            out.append(f"| {task} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |")
        means = [[run.accuracy(t, n) for t in run.tasks] for n in lengths]
        out.append("| **mean** | " + " | ".join(
            f"**{sum(x for x in m if x is not None) / max(1, sum(x is not None for x in m)):.1f}**" for m in means) + " |")
        out.append("")
        needles = [t for t in run.tasks if t in NEEDLE_TASKS]
        for title, rescored in (_STRICTER if needles else ()):
            out.append(f"{title}, policy `{run.policy}`\n")
            out.append("| task | " + " | ".join(_fmt_len(n) for n in lengths) + " |")
            out.append("|---|" + "---|" * len(lengths))
            for task in needles:
                cells = [rescored(run, task, n) for n in lengths]
                out.append(f"| {task} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |")
            out.append("")
    out.append("### device-resident KV per request (KiB, from the allocator)\n")
    lengths = runs[0].lengths
    out.append("| policy | " + " | ".join(_fmt_len(n) for n in lengths) + " |")
    out.append("|---|" + "---|" * len(lengths))
    for run in runs:
        out.append(f"| {run.policy} | " + " | ".join(_kib(run.device_kv(n)) for n in lengths) + " |")
    out.append("")
    return "\n".join(out)


def plots(runs: list[EvalRun], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for run in runs:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for task in run.tasks:
            ys = [run.accuracy(task, n) for n in run.lengths]
            ax.plot(run.lengths, ys, marker="o", label=task)
        ax.set_xscale("log", base=2)
        ax.set_xticks(run.lengths, [_fmt_len(n) for n in run.lengths])
        ax.set_ylim(-2, 102)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(f"accuracy vs length — policy {run.policy}")
        ax.legend(fontsize=7, ncol=2)
        path = out_dir / f"accuracy_{_safe(run.policy)}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
        needle = [t for t in run.tasks if t in NEEDLE_TASKS]
        if needle:
            written.append(_heatmap(run, needle, out_dir, plt))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        ax.plot(run.lengths, [(run.device_kv(n) or 0) / 1024 for n in run.lengths], marker="o", label=run.policy)
    ax.set_xscale("log", base=2)
    ax.set_xticks(runs[0].lengths, [_fmt_len(n) for n in runs[0].lengths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("device-resident KV per request (KiB)")
    ax.set_title("KV on the device (measured from the allocator)")
    ax.legend(fontsize=8)
    path = out_dir / "kv_bytes.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def _heatmap(run: EvalRun, tasks: list[str], out_dir: Path, plt) -> Path:
    """One depth × length panel per needle task (a mean over tasks would hide which one fails)."""
    fig, axes = plt.subplots(1, len(tasks), figsize=(2.2 + 2.3 * len(tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        depths = sorted({round(r.depth, 3) for r in run.results if r.task == task and r.depth is not None})
        grid = []
        for d in depths:
            row = []
            for n in run.lengths:
                rs = [r.score for r in run.results if r.task == task and r.length == n and round(r.depth or -1, 3) == d]
                row.append(100 * sum(rs) / len(rs) if rs else float("nan"))
            grid.append(row)
        im = ax.imshow(grid, aspect="auto", cmap="RdYlGn", vmin=0, vmax=100, origin="lower")
        ax.set_xticks(range(len(run.lengths)), [_fmt_len(n) for n in run.lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=6)
        ax.set_xlabel("context length", fontsize=8)
        ax.set_title(task, fontsize=9)
    axes[0][0].set_ylabel("needle depth")
    fig.suptitle(f"needle tasks, depth × length — policy {run.policy}", fontsize=10)
    fig.colorbar(im, ax=axes[0].tolist(), label="accuracy (%)")
    path = out_dir / f"needle_heatmap_{_safe(run.policy)}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def load_with_command(path: str | Path) -> tuple[list[EvalRun], str]:
    """The runs of a results.json and the command that wrote it."""
    data = json.loads(Path(path).read_text())
    return [EvalRun.from_json(r) for r in data["runs"]], data.get("command", "")


def load(path: str | Path) -> list[EvalRun]:
    return load_with_command(path)[0]


def merge(parts: list[list[EvalRun]]) -> list[EvalRun]:
    """One run per policy from runs of the same model that each covered some tasks and lengths
    (an evaluation split over processes or machines). A (policy, task, length) cell evaluated in
    two parts, or parts of different models or sample counts, is an error, not a silent union.
    `seconds` becomes the parts' sum (process time; parallel parts took less wall time)."""
    merged: dict[str, EvalRun] = {}
    seen: set[tuple[str, str, int]] = set()
    for runs in parts:
        for r in runs:
            cells = {(r.policy, x.task, x.length) for x in r.results}
            if cells & seen:
                raise ValueError(f"policy {r.policy}: {sorted(cells & seen)[0][1:]} is in two results files")
            seen |= cells
            m = merged.get(r.policy)
            if m is None:
                merged[r.policy] = EvalRun(r.model, r.policy, list(r.tasks), list(r.lengths), r.samples,
                                           r.seconds, list(r.results))
                continue
            if (Path(m.model).name, m.samples) != (Path(r.model).name, r.samples):
                raise ValueError(f"policy {r.policy}: {m.model} with {m.samples} samples vs "
                                 f"{r.model} with {r.samples}: not parts of one evaluation")
            m.tasks += [t for t in r.tasks if t not in m.tasks]
            m.lengths = sorted(set(m.lengths) | set(r.lengths))
            m.seconds += r.seconds
            m.results += r.results
    return list(merged.values())


def compare(a: list[EvalRun], b: list[EvalRun], label_a: str = "A", label_b: str = "B") -> str:
    """Side by side: for every policy/task/length present in both, accuracy A, B and the difference;
    then device KV."""
    out = [f"| policy | task | length | {label_a} | {label_b} | Δ |", "|---|---|---|---|---|---|"]
    by_policy = {r.policy: r for r in b}
    for ra in a:
        rb = by_policy.get(ra.policy)
        if rb is None:
            continue
        for task in ra.tasks:
            for n in ra.lengths:
                x, y = ra.accuracy(task, n), rb.accuracy(task, n)
                if x is None or y is None:
                    continue
                out.append(f"| {ra.policy} | {task} | {_fmt_len(n)} | {x:.1f} | {y:.1f} | {y - x:+.1f} |")
        for n in ra.lengths:
            x, y = ra.device_kv(n), rb.device_kv(n)
            if x is not None and y is not None:
                out.append(f"| {ra.policy} | device KV (KiB) | {_fmt_len(n)} | {_kib(x)} | {_kib(y)} | "
                           f"{(y - x) / 1024:+,.1f} |")
    return "\n".join(out)
