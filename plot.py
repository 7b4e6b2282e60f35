"""Plot runs: one figure (PNG, PDF or SVG) with a panel per metric and a line per setting, labelled by the flags
that differ and ordered by their values; runs that differ only in seed are one mean line with a min-max band (a
repeated seed is a line of its own).

    python plot.py runs/grpo__1__1764000000 runs/dapo__1__1764000100 --out compare.png
    python plot.py study/results/cpu/group-size --metrics charts/eval_accuracy losses/entropy --smooth 0.6
    tensorboard --logdir runs                                   # the same curves, live

A folder without metrics.jsonl stands for the run folders inside it. The default panels are the curves
the paper shows: accuracy, entropy, KL to the reference, clip fraction, response length and reward. Accuracy
panels carry the held-out set's baselines (best constant answer, uniform guess) when the runs logged them. Bad
input is a one-line error or a skipped point, never a traceback.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import tyro

import common

DEFAULT_METRICS = ["charts/eval_accuracy", "charts/accuracy", "charts/reward", "charts/response_length",
                   "losses/entropy", "losses/kl_ref", "losses/clipfrac"]
# flags that name or place a run, or what it writes, rather than change its training: never used as labels.
# model_source records where --model's folder was on the machine that ran it; what is trained from is --model
# itself (bundled-warm is always the warm start's defaults, another warm start is another --model folder)
NOT_LABELS = {"exp_name", "runs_dir", "resume", "track", "wandb_project", "wandb_entity", "eval_every", "save_every",
              "keep_checkpoints", "log_samples_every", "final_dtype", "script", "code_versions", "model_source"}
NOT_GROUPED = (NOT_LABELS - {"script"}) | {"seed"}  # runs differing only in these are seeds of one setting
TASK_FLAGS = ("task_min_numbers", "task_max_numbers", "task_max_value", "task_operators")
TITLES = {"charts/eval_accuracy": "Held-out greedy accuracy", "charts/accuracy": "Training accuracy",
          "charts/reward": "Reward", "charts/response_length": "Response length (tokens)",
          "losses/entropy": "Entropy (nats/token)", "losses/kl_ref": "KL to the reference",
          "losses/clipfrac": "Clip fraction", "charts/eval_format_rate": "Held-out format rate",
          "charts/format_rate": "Training format rate",
          "charts/eval_response_length": "Held-out response length (tokens)",
          "losses/approx_kl": "KL between new and old policies", "losses/grad_norm": "Policy gradient norm",
          "losses/surrogate": "Surrogate objective", "time/step": "Time per training step"}
YLABELS = {"charts/eval_accuracy": "share of held-out tasks solved", "charts/accuracy": "share of completions correct",
           "charts/reward": "mean reward", "charts/response_length": "tokens per completion",
           "charts/eval_response_length": "tokens per completion", "losses/entropy": "nats per token",
           "losses/kl_ref": "nats per token (k3 estimate)", "losses/clipfrac": "share of tokens clipped",
           "charts/eval_format_rate": "share well-formed", "charts/format_rate": "share well-formed",
           "losses/approx_kl": "nats per token (k3 estimate)",
           "losses/grad_norm": "L2 norm before clipping, mean over minibatches",
           "losses/surrogate": "min(r A, clip(r) A), mean (no KL, no entropy)",
           "time/step": "seconds (evaluation and checkpoint apart)"}
ACCURACY_PANELS = {"charts/eval_accuracy"}
BASELINES = {"charts/eval_best_constant": ("--", "best constant answer"),
             "charts/eval_uniform_guess": (":", "uniform guess")}
FORMATS = (".png", ".pdf", ".svg")
STYLES = ("-", "-.")  # with 20 colours: 40 distinct lines; "--" and ":" are the baselines'
MAX_LINES = 20  # more lines per panel than colours: warn


@dataclass
class Args:
    runs: tyro.conf.Positional[list[str]]
    """run folders (each with metrics.jsonl), or folders holding run folders"""
    metrics: list[str] = field(default_factory=lambda: list(DEFAULT_METRICS))
    """metrics.jsonl keys, one panel each; those no run logged are left out"""
    out: str = "runs.png"
    """the figure to write; its suffix picks the format: .png, .pdf or .svg"""
    smooth: float = 0.0
    """exponential moving average weight in [0, 1) as TensorBoard's slider (0: raw); the raw curve stays faint"""
    title: str = ""
    """the figure's title"""


def find_runs(paths: list[str]) -> list[Path]:
    """The run folders named, each once: a run given twice (a folder and its parent) must not count as two seeds."""
    runs = []
    for path in map(Path, paths):
        if (path / "metrics.jsonl").is_file():
            runs.append(path)
        elif path.is_dir() and (inner := sorted(p.parent for p in path.glob("*/metrics.jsonl") if p.is_file())):
            runs.extend(inner)
        else:
            raise common.ConfigError(f"runs={str(path)!r} is not allowed: no metrics.jsonl there or in its "
                                     f"sub-folders (a run folder from --runs-dir)")
    return list({run.resolve(): run for run in runs}.values())  # in first-named order


def is_number(value) -> bool:
    """A JSON number a plot can use: not a string, list, bool or an integer beyond float range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return isinstance(float(value), float)
    except OverflowError:
        return False


def read_rows(run: Path) -> list[dict]:
    """The run's metrics.jsonl rows, numbers only, so that one bad point never stops a plot: a line torn by a kill
    mid-write, a row without a finite step and a non-numeric value (hand-edited, foreign) are skipped."""
    try:
        text = (run / "metrics.jsonl").read_text(errors="replace")
    except OSError as err:
        raise common.ConfigError(f"runs={str(run)!r} is not allowed: its metrics.jsonl cannot be read "
                                 f"({err.strerror})") from None
    rows = []
    for row in json_objects(text):
        row = {k: v for k, v in row.items() if is_number(v)}
        if math.isfinite(row.get("step", math.nan)):
            rows.append(row)
    return rows


def json_objects(text: str) -> list[dict]:
    """The objects of a .jsonl text, a line each; a line torn by a kill mid-write or not an object is skipped."""
    objects = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(row, dict):
            objects.append(row)
    return objects


def measured(rows: list[dict], saved: dict) -> list[dict]:
    """The rows without what the run did not measure: at beta = 0 no reference model is loaded, and runs made before
    the scripts stopped logging its KL as 0 carry that 0 in losses/kl_ref; drawn, it would read as a measurement."""
    if saved.get("beta") == 0:
        return [{k: v for k, v in row.items() if k != "losses/kl_ref"} for row in rows]
    return rows


def load_args(run: Path) -> dict:
    """The run's saved flags; a missing, torn or non-object args.json counts as none, so a plot never stops on it."""
    try:
        saved = json.loads((run / "args.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return saved if isinstance(saved, dict) else {}


def group_by_seed(runs: list[Path]) -> list[list[Path]]:
    """Runs whose flags differ only in seed (or in where they were written) are one setting: one line and band.
    A run with the flags and seed of one already grouped differs in what its flags do not record (the code, the
    warm start): it joins the first group, in the order named, that lacks its seed, or starts a line of its own;
    it is never averaged with its own seed."""
    settings: dict[str, list[list[Path]]] = {}
    seeds: dict[Path, str] = {}
    for run in runs:
        saved = load_args(run)
        seeds[run] = json.dumps(saved.get("seed"), default=str)
        flags = {k: v for k, v in saved.items() if k not in NOT_GROUPED}
        key = json.dumps(flags, sort_keys=True, default=str) if flags else str(run)  # no flags: a group of its own
        groups = settings.setdefault(key, [])
        free = next((g for g in groups if seeds[run] not in {seeds[r] for r in g}), None)
        if free is None:
            groups.append([run])
        else:
            free.append(run)
    return [group for groups in settings.values() for group in groups]


def rung_name(saved: dict) -> str:
    """Task settings as the study's ladder names them, e.g. "3-4 numbers ≤ 99, + - * /"."""
    low, high, ops = saved.get("task_min_numbers"), saved.get("task_max_numbers"), saved.get("task_operators", "")
    numbers = f"{low}" if low == high else f"{low}-{high}"
    ops = " ".join(map(str, ops if isinstance(ops, (str, list)) else [ops]))
    return f"{numbers} numbers ≤ {saved.get('task_max_value')}, {ops}"


def shared_rung(groups: list[list[Path]]) -> str:
    """The rung every run trained on, for the figure's title ("" when they differ or a run does not say): the
    legend then names only what differs."""
    saved = [load_args(group[0]) for group in groups]
    if not all(all(k in s for k in TASK_FLAGS) for s in saved):
        return ""
    rungs = {rung_name(s) for s in saved}
    return rungs.pop() if len(rungs) == 1 else ""


def differing_flags(saved: list[dict]) -> list[str]:
    """The flags, in name order, whose values differ between the groups' saved args (runs without args.json aside)."""
    known = [s for s in saved if s]
    shared = set.intersection(*(set(s) for s in known)) if known else set()
    # the script names itself; a flag only one script has (clip_high) says nothing the script name does not
    keys = sorted(shared - NOT_GROUPED - {"script"})
    return [k for k in keys if len({json.dumps(s.get(k), sort_keys=True, default=str) for s in known}) > 1]


def in_flag_order(groups: list[list[Path]]) -> list[list[Path]]:
    """Settings ordered by script, then by the values of the flags that differ (numbers by value: beta 0 before
    0.0075, which a folder name sorts after it), ties in the order named."""
    saved = [load_args(group[0]) for group in groups]
    differing = differing_flags(saved)

    def value(v) -> tuple:
        if is_number(v) and math.isfinite(float(v)):
            return 0, float(v), ""
        return 1, 0.0, json.dumps(v, sort_keys=True, default=str)  # a NaN sorts as a name: a total order

    keys = [(str(s.get("script", "")), *(value(s.get(k)) for k in differing)) for s in saved]
    return [groups[i] for i in sorted(range(len(groups)), key=keys.__getitem__)]  # a stable sort: ties as named


def labels(groups: list[list[Path]]) -> list[str]:
    """Each group (of seeds) named by its script and the flags that differ between groups, task settings as a rung."""
    saved = [load_args(group[0]) for group in groups]
    differing = differing_flags(saved)
    names = []
    for group, s in zip(groups, saved):
        flags = [rung_name(s)] if s and set(differing) & set(TASK_FLAGS) else []
        flags += [f"{k}={s.get(k)}" for k in differing if s and k not in TASK_FLAGS]
        names.append(" ".join(x for x in (str(s.get("script", "")), ", ".join(flags)) if x) or group[0].name)
    if len(set(names)) < len(names):  # same labelled flags (a flag only some scripts have): add the folder
        names = [f"{n} ({group[0].name})" for n, group in zip(names, groups)]
    return [f"{n} ({len(group)} seeds: mean, band min-max)" if len(group) > 1 else n for n, group in zip(names, groups)]


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: a debiased exponential moving average."""
    out, last, norm = [], 0.0, 0.0
    for v in values:
        last, norm = weight * last + (1 - weight) * v, weight * norm + (1 - weight)
        out.append(last / norm)
    return out


def line_style(i: int) -> tuple:
    """Group i's (colour, line style): tab20's strong colours first, then its light ones, then the next style."""
    from matplotlib import colormaps

    order = list(range(0, 20, 2)) + list(range(1, 20, 2))
    return colormaps["tab20"].colors[order[i % 20]], STYLES[(i // 20) % len(STYLES)]


def series(data: list[list[dict]], metric: str) -> tuple[list, list, list, list]:
    """A group's steps and the mean, min and max of `metric` over its seeds, at the steps all of them logged (at
    every logged step when they share none), so that a seed still running does not bend the mean."""
    per_run = [{r["step"]: r[metric] for r in rows if metric in r and math.isfinite(r[metric])} for rows in data]
    per_run = [points for points in per_run if points]
    if not per_run:
        return [], [], [], []
    steps = sorted(set.intersection(*map(set, per_run)) or set().union(*per_run))
    values = [[points[s] for points in per_run if s in points] for s in steps]
    return steps, [sum(v) / len(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def baseline(data: list[list[dict]], metric: str) -> float | None:
    """A group's first logged value of a baseline metric (a property of the held-out set, logged with each eval)."""
    return next((r[metric] for rows in data for r in rows if metric in r and math.isfinite(r[metric])), None)


def draw_group(panel, curve: tuple, style: tuple, smooth: float) -> None:
    """One setting: its mean line and, with several seeds, the min-max band; sparse curves (evals) show points."""
    (steps, mean, low, high), (color, dash) = curve, style
    sparse = len(steps) <= 12
    if smooth and not sparse:
        panel.plot(steps, mean, color=color, linestyle=dash, alpha=0.25, linewidth=0.8)
        mean, low, high = (ema(v, smooth) for v in (mean, low, high))
    if low != high:
        panel.fill_between(steps, low, high, color=color, alpha=0.18, linewidth=0)
    panel.plot(steps, mean, color=color, linestyle=dash, marker="o" if sparse else None, markersize=3)


def draw_baselines(panel, data: list[list[list[dict]]], styles: list[tuple]) -> dict[str, bool]:
    """The held-out set's baselines as horizontal lines: grey when all groups share the value, else each in its
    group's colour (different task settings); returns, for the legend, each baseline drawn and whether it was
    one grey line."""
    drawn = {}
    for key, (dash, _) in BASELINES.items():
        found = [(value, color) for d, (color, _) in zip(data, styles) if (value := baseline(d, key)) is not None]
        # one grey line only when every group logged the same value; a group without it would seem to share it
        if shared := len(found) == len(data) and len({value for value, _ in found}) == 1:
            found = [(found[0][0], "0.35")]
        for value, color in found:
            panel.axhline(value, color=color, linestyle=dash, linewidth=1, alpha=0.9)
        if found:
            drawn[key] = shared
    return drawn


def tex_safe(text: str) -> str:
    """Text shown as typed: a `$` in a flag value or title would otherwise start matplotlib's mathtext."""
    return text.replace("$", r"\$")


def figure(args: Args):
    """The figure, not yet written: a panel per metric, a line (and seed band) per setting, one legend below."""
    from matplotlib.figure import Figure

    runs = find_runs(args.runs)
    groups = in_flag_order(group_by_seed(runs))
    data = [[measured(read_rows(run), load_args(run)) for run in group] for group in groups]
    present = {k for group in data for rows in group for row in rows for k in row}
    metrics = [m for m in args.metrics if m in present]
    if not metrics:
        raise common.ConfigError(f"metrics={args.metrics!r} is not allowed: no run logged any of them; they "
                                 f"logged {sorted(present - {'step'})}")
    if len(groups) > MAX_LINES:
        print(f"plot.py: {len(groups)} lines per panel ({len(runs)} runs) are hard to tell apart; plot fewer runs, "
              f"e.g. one experiment's folder", file=sys.stderr)
    styles = [line_style(i) for i in range(len(groups))]
    columns = min(3, len(metrics))
    fig = Figure(figsize=(5 * columns, 3.4 * math.ceil(len(metrics) / columns)))
    axes = fig.subplots(math.ceil(len(metrics) / columns), columns, squeeze=False)
    baselines: dict[str, bool] = {}
    for panel, metric in zip(axes.flat, metrics):
        for group_data, style in zip(data, styles):
            if (curve := series(group_data, metric))[0]:
                draw_group(panel, curve, style, args.smooth)
        if metric in ACCURACY_PANELS:
            baselines.update(draw_baselines(panel, data, styles))  # the same groups on every panel
        panel.set_title(tex_safe(TITLES.get(metric, metric)))
        panel.set_xlabel("training step")
        panel.set_ylabel(YLABELS.get(metric, ""))
        panel.grid(alpha=0.3)
    for panel in list(axes.flat)[len(metrics):]:
        panel.axis("off")
    if title := ": ".join(x for x in (args.title, shared_rung(groups)) if x):
        fig.suptitle(tex_safe(title))
    fig.tight_layout()
    add_legend(fig, labels(groups), styles, {k: baselines[k] for k in BASELINES if k in baselines})
    return fig


def add_legend(fig, names: list[str], styles: list[tuple], baselines: dict[str, bool]) -> None:
    """One legend below all panels, from every group (a run missing from some panel is still named) and baseline
    (grey when one line served every group, else drawn in each group's colour and named so)."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=color, linestyle=dash) for color, dash in styles]
    handles += [Line2D([], [], color="0.35", linestyle=BASELINES[k][0], linewidth=1) for k in baselines]
    names = [tex_safe(n) for n in names] + [BASELINES[k][1] + ("" if shared else " (in each line's colour)")
                                            for k, shared in baselines.items()]
    fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=min(len(names), 3), fontsize=8,
               frameon=False)


def check_out(out: str) -> str:
    """The format --out's suffix names; a folder, a missing folder or an unwritable place is refused before
    any plotting, so a long plot never fails at its last step."""
    path = Path(out)
    common.require(path.suffix.lower() in FORMATS, "out", out, "a file name ending in .png, .pdf or .svg")
    try:
        problem = out_problem(path)
    except (OSError, ValueError) as err:  # a name too long, a NUL byte, no permission
        problem = f"it cannot be written ({getattr(err, 'strerror', None) or err})"
    if problem:
        raise common.ConfigError(f"--out={out!r} is not allowed: {problem}")
    return path.suffix.lower()[1:]


def out_problem(path: Path) -> str:
    """What keeps a figure from being written at `path` ("" when nothing does), found by opening it to append."""
    if path.is_symlink():
        return "a file, not a symbolic link (the figure would be written where it points)"
    if path.is_dir():
        return "a file name, not a folder"
    if not path.parent.is_dir():
        return f"a file in an existing folder (no folder {str(path.parent)!r})"
    if path.exists() and not path.is_file():
        return "a regular file (this is a device or pipe)"
    existed = path.exists()
    open(path, "ab").close()  # appending nothing: an existing file is left as it is
    if not existed:
        path.unlink()
    return ""


def plot(args: Args) -> str:
    """Check every flag, then draw and write the figure in the format --out's suffix names."""
    common.require(0 <= args.smooth < 1, "smooth", args.smooth, "in [0, 1)")
    fmt = check_out(args.out)
    fig = figure(args)
    try:
        fig.savefig(args.out, format=fmt, dpi=150, bbox_inches="tight")
    except OSError as err:
        raise common.ConfigError(f"--out={args.out!r} is not allowed: writing it failed ({err.strerror})") from None
    panels = ", ".join(panel.get_title() for panel in fig.axes if panel.get_title())
    print(f"{args.out}: {len(find_runs(args.runs))} runs, panels {panels}")
    return args.out


if __name__ == "__main__":
    common.run_command(lambda: plot(tyro.cli(Args, args=sys.argv[1:])))
