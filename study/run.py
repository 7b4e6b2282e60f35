"""The paper's parametric study (its section 3) as commands, at two scales.

    python study/run.py group-size --scale cpu             # runs GRPO with G = 2, 4, 8, then plots them
    python study/run.py all --scale paper --dry-run        # prints every GPU command of the paper's study
    python study/run.py algorithms --scale cpu --steps 20  # fewer steps than the experiment's default

`--scale paper` uses the paper's settings (Qwen2.5-1.5B-Instruct, the Countdown hub dataset, 1,024 new
tokens, 256 prompts per step, README "The paper's setup"). `--scale cpu` runs the same comparison on the
bundled SmolLM2-135M-Instruct after study/warm_start.py (a format-only warm start, made once and reused:
the untrained model never writes a well-formed answer) on the easiest rung of generated tasks (two
numbers up to 20, `+`), shrunk to minutes per run on a 2-core CPU.

Each experiment writes its runs under `<root>/<scale>/<experiment>/` and its figure beside them
(`<experiment>.png`, made with plot.py). Runs go one after another; a study that was stopped continues
where it stopped: a finished run is skipped, an unfinished one resumes from its newest checkpoint.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from plot import read_rows  # noqa: E402

# What every run of a scale shares. Paper: README "The paper's setup".
PAPER = dict(model="Qwen/Qwen2.5-1.5B-Instruct", dataset="Jiayi-Pan/Countdown-Tasks-3to4", max_new_tokens=1024,
             learning_rate=1e-6, num_steps=520, eval_every=20, eval_size=256, save_every=20)
PAPER_SCRIPT = {  # each algorithm at the paper's values
    "ppo": dict(prompts_per_step=256, group_size=1, num_minibatches=2, critic_learning_rate=1e-5, beta=0.001,
                micro_batch_size=4),
    "grpo": dict(prompts_per_step=256, group_size=8, num_minibatches=4, beta=0.01, micro_batch_size=8),
    "dapo": dict(prompts_per_step=256, group_size=8, num_minibatches=4, clip_low=0.2, clip_high=0.28, beta=0.0,
                 dynamic_sampling=False, micro_batch_size=8),
}
# CPU: the warm-started bundled model on the easiest rung; 32 completions per step for every algorithm
CPU = dict(task_min_numbers=2, task_max_numbers=2, task_max_value=20, task_operators="+", max_new_tokens=48,
           learning_rate=3e-5, num_steps=20, eval_every=5, eval_size=64, test_size=64, save_every=5,
           keep_checkpoints=1, micro_batch_size=16, log_samples_every=5)
CPU_SCRIPT = {
    "ppo": dict(prompts_per_step=32, group_size=1, num_minibatches=2, critic_learning_rate=1e-4, beta=0.001),
    "grpo": dict(prompts_per_step=4, group_size=8, num_minibatches=2, beta=0.01),
    "dapo": dict(prompts_per_step=4, group_size=8, num_minibatches=2, clip_low=0.2, clip_high=0.28, beta=0.0,
                 dynamic_sampling=False),
}

# experiment -> (what the paper shows, [(variant name, script, flags over the scale's script defaults)])
CPU_ONLY = {"ladder"}  # the paper trains on the hub dataset: task difficulty is a CPU-scale knob
EXPERIMENTS = {
    "ladder": ("Ladder: GRPO from the warm start on rungs of generated tasks, easiest first", [
        ("rung1-2nums-plus", "grpo", {}),
        ("rung2-2nums-plusminus", "grpo", dict(task_operators="+-")),
        ("rung3-3nums-plusminus", "grpo", dict(task_min_numbers=3, task_max_numbers=3, task_operators="+-")),
        ("rung4-standard", "grpo", dict(task_min_numbers=3, task_max_numbers=4, task_max_value=99,
                                        task_operators="+-*/", max_new_tokens=64))]),
    "algorithms": ("Table 3 / section 4: PPO vs GRPO vs DAPO (no dynamic sampling) at the same number of steps", [
        ("grpo", "grpo", {}), ("dapo", "dapo", {}), ("ppo", "ppo", {})]),
    "entropy": ("Fig. 3: PPO with and without an entropy bonus (c2 = 0.001, verl's former default; "
                "the paper gives no value)", [
        ("ent-0", "ppo", dict(ent_coef=0.0)), ("ent-0.001", "ppo", dict(ent_coef=0.001))]),
    "learning-rate": ("Fig. 4: PPO at the paper's learning rate and 10x it (the paper does not give the larger one)", [
        ("lr-base", "ppo", {}), ("lr-10x", "ppo", dict(learning_rate_scale=10.0))]),
    "group-size": ("Fig. 5: GRPO with G = 2, 4, 8 (same prompts per step)", [
        (f"G{g}", "grpo", dict(group_size=g)) for g in (2, 4, 8)]),
    "kl": ("Fig. 6: GRPO with beta = 0, 0.0075, 0.01, 0.04", [
        (f"beta-{b}", "grpo", dict(beta=b)) for b in (0.0, 0.0075, 0.01, 0.04)]),
    "loss-aggregation": ("Section 3.4: GRPO's sample-level loss vs the same run with DAPO's token-level loss "
                         "(dapo.py with GRPO's clip range and KL, no dynamic sampling, no overlong shaping)", [
        ("sample-level", "grpo", {}),
        ("token-level", "dapo", dict(clip_high=0.2, beta=0.01, dynamic_sampling=False))]),
    "dynamic-sampling": ("Fig. 7: DAPO with and without dynamic sampling (G = 8)", [
        ("no-ds", "dapo", dict(dynamic_sampling=False)), ("ds", "dapo", dict(dynamic_sampling=True))]),
    "dapo-group-size": ("Fig. 8: DAPO with G = 2 (with and without KL), 4, 8", [
        ("G2-beta0", "dapo", dict(group_size=2, beta=0.0)), ("G2-beta0.01", "dapo", dict(group_size=2, beta=0.01)),
        ("G4", "dapo", dict(group_size=4)), ("G8", "dapo", dict(group_size=8))]),
}


@dataclass
class Args:
    experiment: tyro.conf.Positional[Literal["all", "ladder", "algorithms", "entropy", "learning-rate", "group-size", "kl",
                                             "loss-aggregation", "dynamic-sampling", "dapo-group-size"]]
    """which figure of the paper's section 3 (or `all`)"""
    scale: Literal["cpu", "paper"] = "cpu"
    """`paper`: the paper's model, data and batch (GPUs); `cpu`: the bundled model, warm-started, easiest rung"""
    dry_run: bool = False
    """print the commands instead of running them"""
    root: str = "study/results"
    """where the runs and figures go (`<root>/<scale>/<experiment>/`); git keeps their metrics, args and figures"""
    steps: int = 0
    """training steps per run (0: the scale's default, 520 paper / 20 cpu)"""
    warm_start: str = "study/results/warm_start"
    """--scale cpu: the warm-started model (made by study/warm_start.py when missing)"""
    summary: bool = False
    """print a markdown table of the experiment's runs (as in study/README.md) instead of running anything"""
    only: tuple[str, ...] = ()
    """run only these variants of the experiment (e.g. `--only grpo dapo`); default: all"""
    extra: str = ""
    """more flags for every run, e.g. \"--backend vllm\" or \"--micro-batch-size 4\""""


def flag_list(flags: dict) -> list[str]:
    out = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return out


def run_commands(args: Args, experiment: str) -> list[tuple[str, list[str]]]:
    """(variant, command) for each run of the experiment, each resumed or skipped as its folder says."""
    base, per_script = (PAPER, PAPER_SCRIPT) if args.scale == "paper" else (CPU, CPU_SCRIPT)
    out_dir = Path(args.root) / args.scale / experiment
    commands = []
    for variant, script, changes in EXPERIMENTS[experiment][1]:
        if args.only and variant not in args.only:
            continue
        flags = {**base, **per_script[script], **changes}
        if args.scale == "cpu":
            flags["model"] = args.warm_start
        if args.steps:
            flags["num_steps"] = args.steps
        if "learning_rate_scale" in flags:
            flags["learning_rate"] = flags["learning_rate"] * flags.pop("learning_rate_scale")
        flags.update(exp_name=variant, runs_dir=str(out_dir))
        state, folder = run_state(out_dir, variant, flags["num_steps"])
        if state == "finished":
            continue
        cmd = [sys.executable, str(ROOT / f"{script}.py")] + flag_list(flags) + shlex.split(args.extra)
        if state == "resumable":
            cmd = [sys.executable, str(ROOT / f"{script}.py"), "--resume", str(folder), "--num-steps",
                   str(flags["num_steps"])]
        commands.append((variant, cmd))
    return commands


def run_state(out_dir: Path, variant: str, num_steps: int) -> tuple[str, Path | None]:
    """`finished` (its metrics reached num_steps), `resumable` (a checkpoint to go on from) or `new`."""
    folders = sorted(out_dir.glob(f"{variant}__*"), key=lambda p: p.stat().st_mtime) if out_dir.is_dir() else []
    for folder in reversed(folders):
        steps = [row["step"] for row in read_rows(folder)] if (folder / "metrics.jsonl").is_file() else []
        if steps and max(steps) >= num_steps:
            return "finished", folder
        if common.complete_checkpoints(folder):
            return "resumable", folder
    return "new", None


def summary_table(out_dir: Path) -> str:
    """One markdown row per run under out_dir: held-out greedy accuracy at step 0, at the end and its best,
    the first step it reached 50%, the last step's entropy and response length, seconds per step, wall time."""
    lines = ["| run | steps | eval acc step 0 | final | best | first step >= 50% | entropy | length | s/step | wall |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for folder in sorted(p for p in out_dir.glob("*__*") if (p / "metrics.jsonl").is_file()):
        rows = read_rows(folder)
        evals = [(r["step"], r["charts/eval_accuracy"]) for r in rows if "charts/eval_accuracy" in r]
        train = [r for r in rows if r["step"] >= 1]
        if not evals or not train:
            continue
        reached = next((step for step, acc in evals if acc >= 0.5), None)
        step_times = sorted(r["time/step"] for r in train)
        started = int(folder.name.split("__")[-1].split("_")[0])
        wall = (folder / "metrics.jsonl").stat().st_mtime - started
        lines.append(f"| {folder.name.split('__')[0]} | {train[-1]['step']} | {evals[0][1]:.3f} | {evals[-1][1]:.3f} | "
                     f"{max(a for _, a in evals):.3f} | {reached if reached is not None else '-'} | "
                     f"{train[-1].get('losses/entropy', float('nan')):.3f} | {train[-1]['charts/response_length']:.1f} | "
                     f"{step_times[len(step_times) // 2]:.0f} | {wall / 60:.0f} min |")
    return "\n".join(lines)


def shown(cmd: list[str]) -> str:
    """The command as a person would type it: `python grpo.py ...` from the repository root."""
    script = Path(cmd[1])
    return shlex.join(["python", str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else str(script)]
                      + cmd[2:])


def main(args: Args) -> int:
    common.require(args.steps >= 0, "steps", args.steps, ">= 0 (0: the scale's default)")
    experiments = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    if args.scale == "paper":
        common.require(args.experiment not in CPU_ONLY, "experiment", args.experiment,
                       "a figure of the paper (the ladder of generated tasks is a CPU-scale experiment)")
        experiments = [e for e in experiments if e not in CPU_ONLY]
    for experiment in experiments:
        known = {v for v, _, _ in EXPERIMENTS[experiment][1]}
        common.require(args.experiment == "all" or set(args.only) <= known, "only", list(args.only),
                       f"variants of {experiment}: {sorted(known)}")
    if args.summary:
        for experiment in experiments:
            print(f"# {experiment}\n\n{summary_table(Path(args.root) / args.scale / experiment)}\n")
        return 0
    if args.scale == "cpu" and not Path(args.warm_start, "config.json").is_file():
        cmd = [sys.executable, str(ROOT / "study" / "warm_start.py"), "--out", args.warm_start]
        print("$ " + shown(cmd), flush=True)
        if not args.dry_run and subprocess.run(cmd).returncode != 0:
            return 1
    for experiment in experiments:
        print(f"# {experiment}: {EXPERIMENTS[experiment][0]}", flush=True)
        for variant, cmd in run_commands(args, experiment):
            print("$ " + shown(cmd), flush=True)
            if not args.dry_run and subprocess.run(cmd).returncode != 0:
                print(f"study: {experiment}/{variant} failed; run the same command again to continue", file=sys.stderr)
                return 1
        out_dir = Path(args.root) / args.scale / experiment
        plot = [sys.executable, str(ROOT / "plot.py"), str(out_dir), "--out", str(out_dir) + ".png",
                "--title", EXPERIMENTS[experiment][0].split(":")[0] + f" ({args.scale} scale)"]
        print("$ " + shown(plot), flush=True)
        if not args.dry_run and subprocess.run(plot).returncode != 0:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(common.exit_on_config_error(lambda: main(tyro.cli(Args))))
