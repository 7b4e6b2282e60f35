"""Two runs of one seed, compared step by step while they still sample the same completions.

    python study/paired.py study/results/cpu/entropy/ent-0.001__1__1796516608 \
        study/results/cpu/entropy/ent-0__1__1796135602

A run's generation seed at each step is a function of its seed, step and rank (`common.generation_seed`), so two
runs of one seed that differ in one flag draw the same completions until their policies have moved apart far enough
to change a sampled token. Over those steps the flag's own effect on a training quantity (entropy, clipping, KL) is
measured without the noise between seeds, which at 60 steps is larger than most effects the paper reports.

Prints a markdown table: per training step, whether the two runs logged the same rollout statistics (ROLLOUT,
which depend on the completions alone: a "no" proves the completions differ, a "yes" does not prove them the same),
how many of the logged completions (`samples.jsonl`, every `--log-samples-every` steps) are identical, and for each
metric the first run's value minus the second's, relative to the second's magnitude ("0": exactly equal).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from plot import json_objects, load_args, read_rows  # noqa: E402


@dataclass
class Args:
    runs: tyro.conf.Positional[tuple[str, str]]
    """the two run folders (each with metrics.jsonl, args.json and samples.jsonl), of one seed"""
    metrics: list[str] = field(default_factory=lambda: ["losses/entropy", "losses/clipfrac", "losses/approx_kl",
                                                        "losses/kl_ref"])
    """training quantities to compare, metrics.jsonl keys"""
    steps: int = 20
    """compare training steps 1..steps"""


ROLLOUT = ("charts/reward", "charts/accuracy", "charts/format_rate", "charts/response_length",
           "charts/truncated_fraction", "charts/zero_std_fraction")
"""what a step logs that depends on its completions alone (and the task), not on the update"""


def logged_completions(run: Path) -> dict[int, list[tuple]]:
    """step -> the (prompt, completion) pairs samples.jsonl logged at it, in order; torn or foreign lines are
    skipped."""
    by_step: dict[int, list[tuple]] = {}
    try:
        text = (run / "samples.jsonl").read_text(errors="replace")
    except OSError:
        return by_step
    for row in json_objects(text):
        if isinstance(row.get("step"), int) and isinstance(row.get("completion"), str):
            by_step.setdefault(row["step"], []).append((row.get("prompt"), row["completion"]))
    return by_step


def relative(a: float | None, b: float | None) -> str:
    """a - b relative to |b|, so that the sign is a's direction for negative quantities (the surrogate) too."""
    if a is None or b is None:
        return "-"
    if math.isnan(a) or math.isnan(b):
        return "nan"  # a skipped update's gradient norm: not a change
    if a == b:
        return "0"  # exactly: the flag did not reach this quantity at this step
    if b == 0:
        return f"{a:+.3g} (from 0)"
    return f"{100 * (a - b) / abs(b):+.2f}%"


def paired_table(first: Path, second: Path, metrics: list[str], steps: int) -> str:
    rows = [{int(r["step"]): r for r in read_rows(run) if "charts/reward" in r and r["step"] == int(r["step"])}
            for run in (first, second)]
    seeds = [load_args(run).get("seed") for run in (first, second)]
    for run, seed in zip((first, second), seeds):
        if seed is None:
            raise common.ConfigError(f"runs={str(run)!r} is not allowed: its args.json records no seed (a run "
                                     f"folder of grpo.py, dapo.py or ppo.py is allowed)")
    if seeds[0] != seeds[1]:
        raise common.ConfigError(f"runs={[str(first), str(second)]!r} is not allowed: their args.json seeds are "
                                 f"{seeds[0]!r} and {seeds[1]!r}; a pair is two runs of one seed")
    unknown = [m for m in metrics if not any(m in row for by_step in rows for row in by_step.values())]
    common.require(not unknown, "metrics", unknown, "metrics.jsonl keys that one of the runs logged")
    samples = [logged_completions(run) for run in (first, second)]
    lines = ["| step | same rollout statistics | logged completions alike | "
             + " | ".join(f"`{m}`" for m in metrics) + " |",
             "|---|---|---|" + "---|" * len(metrics)]
    for step in range(1, steps + 1):
        if step not in rows[0] and step not in rows[1]:
            continue
        if step not in rows[0] or step not in rows[1]:  # one run stopped earlier or lost the row
            only = "first" if step in rows[0] else "second"
            lines.append(f"| {step} | only the {only} run | - | " + " | ".join("-" for _ in metrics) + " |")
            continue
        a, b = rows[0][step], rows[1][step]
        same_rollout = "yes" if all(abs(a[k] - b[k]) <= 1e-6 for k in ROLLOUT if k in a and k in b) else "no"
        alike = "-"
        if step in samples[0] and step in samples[1]:
            ours, theirs = samples[0][step], samples[1][step]
            alike = f"{sum(x == y for x, y in zip(ours, theirs))} of {len(ours)}"
            if len(theirs) != len(ours):
                alike += f" ({len(theirs)} in the second)"
        cells = [relative(a.get(m), b.get(m)) for m in metrics]
        lines.append(f"| {step} | {same_rollout} | {alike} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(args: Args) -> int:
    first, second = (Path(run) for run in args.runs)
    common.require(args.steps >= 1, "steps", args.steps, ">= 1")
    print(paired_table(first, second, args.metrics, args.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_command(lambda: main(tyro.cli(Args))))
