"""Plot runs: one PNG with a panel per metric and a line per run, labelled by the flags that differ.

    python plot.py runs/grpo__1__1764000000 runs/dapo__1__1764000100 --out compare.png
    python plot.py study/cpu/group_size --metrics charts/eval_accuracy losses/entropy --smooth 0.6
    tensorboard --logdir runs                                   # the same curves, live

A folder without metrics.jsonl stands for the run folders inside it. The default panels are the curves
the paper shows: accuracy, entropy, KL to the reference, clip fraction, response length and reward.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import tyro

import common

DEFAULT_METRICS = ["charts/eval_accuracy", "charts/accuracy", "charts/reward", "charts/response_length",
                   "losses/entropy", "losses/kl_ref", "losses/clipfrac"]
# flags that name or place a run rather than change it: never used as labels
NOT_LABELS = {"exp_name", "runs_dir", "resume", "track", "wandb_project", "eval_every", "save_every",
              "keep_checkpoints", "log_samples_every", "script"}


@dataclass
class Args:
    runs: tyro.conf.Positional[list[str]]
    """run folders (each with metrics.jsonl), or folders holding run folders"""
    metrics: list[str] = field(default_factory=lambda: list(DEFAULT_METRICS))
    """metrics.jsonl keys, one panel each; those no run logged are left out"""
    out: str = "runs.png"
    """the PNG to write"""
    smooth: float = 0.0
    """exponential moving average weight in [0, 1) as TensorBoard's slider (0: raw); the raw curve stays faint"""
    title: str = ""
    """the figure's title"""


def find_runs(paths: list[str]) -> list[Path]:
    runs = []
    for path in map(Path, paths):
        if (path / "metrics.jsonl").is_file():
            runs.append(path)
        elif path.is_dir() and (inner := sorted(p.parent for p in path.glob("*/metrics.jsonl"))):
            runs.extend(inner)
        else:
            raise common.ConfigError(f"runs={str(path)!r} is not allowed: no metrics.jsonl there or in its "
                                     f"sub-folders (a run folder from --runs-dir)")
    return runs


def read_rows(run: Path) -> list[dict]:
    """The run's metrics.jsonl rows; a line torn by a kill mid-write is skipped."""
    rows = []
    for line in (run / "metrics.jsonl").read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
            if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
                rows.append(row)
        except ValueError:
            pass
    return rows


def labels(runs: list[Path]) -> list[str]:
    """Each run named by its script and the flags whose values differ between the runs."""
    saved = []
    for run in runs:
        try:
            saved.append(json.loads((run / "args.json").read_text()))
        except (OSError, ValueError):
            saved.append({})
    shared = set.intersection(*(set(s) for s in saved)) if saved else set()
    keys = sorted(shared - NOT_LABELS)  # a flag only one script has (clip_high) says nothing the script name does not
    differing = [k for k in keys if len({json.dumps(s.get(k)) for s in saved}) > 1]
    names = []
    for run, s in zip(runs, saved):
        flags = ", ".join(f"{k}={s.get(k)}" for k in differing)
        script = s.get("script", "")
        names.append(" ".join(x for x in (script, flags) if x) or run.name)
    if len(set(names)) < len(names):  # same flags (e.g. seeds of one setting): add the folder
        names = [f"{n} ({run.name})" for n, run in zip(names, runs)]
    return names


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: a debiased exponential moving average."""
    out, last, norm = [], 0.0, 0.0
    for v in values:
        last, norm = weight * last + (1 - weight) * v, weight * norm + (1 - weight)
        out.append(last / norm)
    return out


def plot(args: Args) -> str:
    common.require(0 <= args.smooth < 1, "smooth", args.smooth, "in [0, 1)")
    common.require(args.out.endswith(".png"), "out", args.out, "a .png file name")
    runs = find_runs(args.runs)
    data = [read_rows(run) for run in runs]
    present = {k for rows in data for row in rows for k in row}
    metrics = [m for m in args.metrics if m in present]
    if not metrics:
        raise common.ConfigError(f"metrics={args.metrics!r} is not allowed: no run logged any of them; they "
                                 f"logged {sorted(present - {'step'})}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, len(metrics))
    rows_ = math.ceil(len(metrics) / columns)
    fig, axes = plt.subplots(rows_, columns, figsize=(5 * columns, 3.4 * rows_), squeeze=False)
    names = labels(runs)
    for panel, metric in zip(axes.flat, metrics):
        for i, (rows, name) in enumerate(zip(data, names)):
            points = [(r["step"], r[metric]) for r in rows if metric in r and math.isfinite(r[metric])]
            if not points:
                continue
            steps, values = zip(*points)
            color = f"C{i % 10}"
            sparse = len(points) <= 12  # evaluations every N steps: show the points
            if args.smooth and not sparse:
                panel.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
                values = ema(list(values), args.smooth)
            panel.plot(steps, values, color=color, label=name, marker="o" if sparse else None, markersize=3)
        panel.set_title(metric)
        panel.set_xlabel("step")
        panel.grid(alpha=0.3)
    for panel in list(axes.flat)[len(metrics):]:
        panel.axis("off")
    handles, legend_labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, legend_labels, loc="lower center", ncol=min(len(runs), 3), fontsize=8, frameon=False)
    if args.title:
        fig.suptitle(args.title)
    legend_rows = math.ceil(len(runs) / 3)
    fig.tight_layout(rect=(0, 0.04 * legend_rows + 0.02, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    plt.close(fig)
    print(f"{args.out}: {len(runs)} runs, panels {', '.join(metrics)}")
    return args.out


if __name__ == "__main__":
    common.exit_on_config_error(lambda: plot(tyro.cli(Args, args=sys.argv[1:])))
