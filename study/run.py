"""The paper's parametric study (its section 3) as commands, at two scales.

    python study/run.py group-size --scale cpu             # runs GRPO with G = 2, 4, 8, then plots them
    python study/run.py all --scale paper --dry-run        # prints every GPU command of the paper's study
    python study/run.py algorithms --scale cpu --steps 20  # fewer steps than the experiment's default

`--scale paper` uses the paper's settings (Qwen2.5-1.5B-Instruct, the Countdown hub dataset, 1,024 new
tokens, 256 prompts per step, README "The paper's setup"). `--scale cpu` runs the same comparison on the
bundled SmolLM2-135M-Instruct after study/warm_start.py (a format-only warm start, made once and reused:
in 48 new tokens the untrained model almost never writes a well-formed answer) on generated tasks of two
numbers up to 20 and `+ *`, whose held-out split is half sums and half products (the best constant answer
scores 50%), shrunk to about an hour per run on a 2-core CPU. `--seeds 1 2 3` runs each variant with three seeds.

Each experiment writes its runs under `<root>/<scale>/<experiment>/` and its figure beside them
(`<experiment>.png` and `.pdf`, made with plot.py). Runs go one after another; a study that was stopped continues
where it stopped: a finished run is skipped, an unfinished one resumes from its newest checkpoint.
"""

from __future__ import annotations

import contextlib
import decimal
import fcntl
import importlib
import json
import math
import os
import random
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from itertools import combinations
from pathlib import Path
from statistics import fmean, median
from typing import Literal

import tyro
from filelock import FileLock, Timeout

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import bookkeeping  # noqa: E402
import common  # noqa: E402
import evaluate  # noqa: E402
from plot import DEFAULT_METRICS, NOT_LABELS, read_rows, rung_name  # noqa: E402

# What every run of a scale shares. Paper: README "The paper's setup".
PAPER = dict(model="Qwen/Qwen2.5-1.5B-Instruct", dataset="Jiayi-Pan/Countdown-Tasks-3to4", max_new_tokens=1024,
             learning_rate=1e-6, num_steps=520, eval_every=20, eval_size=256, test_size=1024, save_every=20)
PAPER_SCRIPT = {  # each algorithm at the paper's values
    "ppo": dict(prompts_per_step=256, group_size=1, num_minibatches=4, critic_learning_rate=1e-5, beta=0.001,
                ent_coef=0.001, clip_value=0.5, weight_decay=0.01, micro_batch_size=4),  # TinyZero's (docs/peers.md)
    "grpo": dict(prompts_per_step=256, group_size=8, num_minibatches=4, beta=0.01, micro_batch_size=8),
    "dapo": dict(prompts_per_step=256, group_size=8, num_minibatches=4, clip_low=0.2, clip_high=0.28, beta=0.0,
                 dynamic_sampling=False, micro_batch_size=8),
}
# CPU: the warm-started bundled model (--model bundled-warm) on a rung whose best constant answer scores 50%:
# two numbers up to 20, `+ *`, held-out split balanced between sums and products (common.generate_tasks). Both
# operators commute, so the order of the numbers never decides; with `+ -` a difference must put the larger
# number first, `+` was right more often at the start, and GRPO collapsed to "always add" (study/README.md)
CPU = dict(model="bundled-warm", task_min_numbers=2, task_max_numbers=2, task_max_value=20, task_operators="+*",
           max_new_tokens=48, learning_rate=1e-5, num_steps=60, eval_every=10, eval_size=128, test_size=128,
           save_every=5, keep_checkpoints=1, micro_batch_size=16, log_samples_every=5)
CPU_SCRIPT = {  # 32 completions per step for every algorithm, over 16 prompts (G = 2) so that each step holds sums
    # and products alike: with 4 or 8 prompts the policy swung from one operator to the other (study/README, pilots);
    # DAPO with dynamic sampling (dynamic-sampling's ds) generates up to 4 such batches and trains on at most 32
    "ppo": dict(prompts_per_step=32, group_size=1, num_minibatches=2, critic_learning_rate=1e-4, beta=0.001),
    "grpo": dict(prompts_per_step=16, group_size=2, num_minibatches=2, beta=0.01),
    "dapo": dict(prompts_per_step=16, group_size=2, num_minibatches=2, clip_low=0.2, clip_high=0.28, beta=0.0,
                 dynamic_sampling=False),
}

# experiment -> (what the paper shows, [(variant name, script, flags over the scale's script defaults)])
CPU_ONLY = {"ladder", "harder-rung"}  # the paper trains on the hub dataset: task difficulty is a CPU-scale knob
EXPERIMENTS = {
    "ladder": ("Ladder: GRPO from the warm start on rungs of generated tasks (held-out best constant in brackets)", [
        ("rung1-2nums-plus", "grpo", dict(task_operators="+")),                                  # 100%: a sanity check
        ("rung2-2nums-plustimes", "grpo", {}),                                                  # 50%: the CPU rung
        ("rung2b-2nums-plusminus", "grpo", dict(task_operators="+-")),                          # 50%, order matters
        ("rung3-2nums-plusminustimes", "grpo", dict(task_operators="+-*")),                     # 34%
        ("rung4-3nums-plusminus", "grpo", dict(task_min_numbers=3, task_max_numbers=3, task_operators="+-")),  # 34%
        ("rung5-standard", "grpo", dict(task_min_numbers=3, task_max_numbers=4, task_max_value=99,
                                        task_operators="+-*/", max_new_tokens=64))]),             # 12%
    "algorithms": ("Table 3 / section 4: PPO vs GRPO vs DAPO (no dynamic sampling) at the same number of steps", [
        ("grpo", "grpo", {}), ("dapo", "dapo", {}), ("ppo", "ppo", {})]),
    "harder-rung": ("Rung 3 of the ladder, run by each algorithm: two numbers up to 20, `+ - *` "
                    "(best constant 33.6%)", [
        (name, name, dict(task_operators="+-*")) for name in ("grpo", "dapo", "ppo")]),
    "entropy": ("Fig. 3: PPO with and without an entropy bonus (c2 = 0.001, verl's former default; "
                "the paper gives no value)", [
        ("ent-0", "ppo", dict(ent_coef=0.0)), ("ent-0.001", "ppo", dict(ent_coef=0.001))]),
    "learning-rate": ("Fig. 4: PPO at the scale's learning rate and 10x it (the paper does not give the larger one)", [
        ("lr-base", "ppo", {}), ("lr-10x", "ppo", dict(learning_rate_scale=10.0))]),
    "group-size": ("Fig. 5: GRPO with G = 2, 4, 8 at the same prompts per step, and G = 4, 8 at G = 2's completions "
                   "per step", [(f"G{g}", "grpo", dict(group_size=g)) for g in (2, 4, 8)] + [
        (f"G{g}-same-completions", "grpo", dict(group_size=g, prompts_per_step_scale=2 / g)) for g in (4, 8)]),
    "kl": ("Fig. 6: GRPO with beta = 0, 0.0075, 0.01, 0.04", [
        (f"beta-{b}", "grpo", dict(beta=b)) for b in (0.0, 0.0075, 0.01, 0.04)]),
    "loss-aggregation": ("Section 3.4: GRPO's sample-level loss vs the same run with DAPO's token-level loss "
                         "(dapo.py with GRPO's clip range and KL, no dynamic sampling, no overlong shaping)", [
        ("sample-level", "grpo", {}),
        ("token-level", "dapo", dict(clip_high=0.2, beta=0.01, dynamic_sampling=False))]),
    "dynamic-sampling": ("Fig. 7: DAPO with and without dynamic sampling (G = 8 at paper scale, 2 at CPU scale)", [
        ("no-ds", "dapo", dict(dynamic_sampling=False)), ("ds", "dapo", dict(dynamic_sampling=True))]),
    "dapo-group-size": ("Fig. 8: DAPO with G = 2 (with and without KL), 4, 8 (the paper names G = 2 with and "
                        "without KL; G = 4 and the KL run's beta 0.01 are this study's choices)", [
        ("G2-beta0", "dapo", dict(group_size=2, beta=0.0)), ("G2-beta0.01", "dapo", dict(group_size=2, beta=0.01)),
        ("G4", "dapo", dict(group_size=4)), ("G8", "dapo", dict(group_size=8))]),
}


@dataclass
class Args:
    experiment: tyro.conf.Positional[Literal["all", "ladder", "algorithms", "harder-rung", "entropy", "learning-rate",
                                             "group-size", "kl", "loss-aggregation", "dynamic-sampling",
                                             "dapo-group-size"]]
    """which figure of the paper's section 3, a CPU-scale experiment (`ladder`, `harder-rung`), or `all`"""
    scale: Literal["cpu", "paper"] = "cpu"
    """`paper`: the paper's model, data and batch (GPUs); `cpu`: the bundled model, warm-started, a 2-number rung"""
    dry_run: bool = False
    """print the commands instead of running them"""
    root: str = "study/results"
    """where the runs and figures go (`<root>/<scale>/<experiment>/`); git keeps their metrics, args and figures"""
    steps: int = 0
    """training steps per run (0: the scale's default, 520 paper / 60 cpu)"""
    seeds: tuple[int, ...] = (1,)
    """run every variant with each of these seeds (e.g. `--seeds 1 2 3`); figures show their mean and range"""
    summary: bool = False
    """print markdown tables of the experiment's runs (as in study/README.md) and whether the paper's findings
    held, instead of running anything"""
    baselines: bool = False
    """print each rung's held-out split (tasks per operator of the hidden solution) and what the best constant
    answer and a uniform guess score on the tasks the runs evaluate on, instead of running anything (CPU scale)"""
    only: tuple[str, ...] = ()
    """run only these variants of the experiment (e.g. `--only grpo dapo`); default: all"""
    extra: str = ""
    """more flags for every run, as one string: `--extra="--backend vllm"` (with `=`, since the value starts with --)"""


def flag_list(flags: dict) -> list[str]:
    out = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return out


def variant_flags(scale: str, name: str, script: str, changes: dict, steps: int = 0) -> dict:
    """The script flags of one variant at a scale: the scale's defaults, the script's, the variant's changes,
    with its scale factors applied (steps: 0 keeps the scale's --num-steps)."""
    base, per_script = (PAPER, PAPER_SCRIPT) if scale == "paper" else (CPU, CPU_SCRIPT)
    flags = {**base, **per_script[script], **changes}
    if steps:
        flags["num_steps"] = steps
    if "learning_rate_scale" in flags:
        flags["learning_rate"] = flags["learning_rate"] * flags.pop("learning_rate_scale")
    if "prompts_per_step_scale" in flags:
        prompts = flags["prompts_per_step"] * flags.pop("prompts_per_step_scale")
        if prompts < 1 or prompts != int(prompts):
            raise ValueError(f"{name}: {prompts} prompts per step is not a whole number >= 1")
        flags["prompts_per_step"] = int(prompts)
    return flags


def run_commands(args: Args, experiment: str) -> list[tuple[str, list[str]]]:
    """(variant, command) for each run of the experiment and seed, each resumed, replaced or skipped as its
    folder says."""
    out_dir = Path(args.root) / args.scale / experiment
    commands = []
    for seed in args.seeds:  # every variant's first seed before any second one: a stopped study compares all
        for variant, script, changes in EXPERIMENTS[experiment][1]:
            if args.only and variant not in args.only:
                continue
            flags = variant_flags(args.scale, f"{experiment}/{variant}", script, changes, args.steps)
            flags.update(exp_name=variant, seed=seed, runs_dir=str(out_dir))
            state, folder = run_state(out_dir, variant, flags["num_steps"], seed, args.dry_run)
            if state == "finished":
                continue
            cmd = [sys.executable, str(ROOT / f"{script}.py")] + flag_list(flags) + shlex.split(args.extra)
            if state == "new" and (earlier := same_run_elsewhere(out_dir, cmd)):
                link_run(out_dir / f"{variant}__{seed}__{earlier.name.split('__')[-1]}", earlier, args.dry_run)
                continue
            if state == "resumable":
                cmd = [sys.executable, str(ROOT / f"{script}.py"), "--resume", str(folder), "--num-steps",
                       str(flags["num_steps"])]
            label = variant if args.seeds == (1,) else f"{variant} seed {seed}"
            commands.append((label, cmd))
    return commands


def training_flags(cmd: list[str]) -> dict:
    """What a script command trains: its flags as args.json records them (JSON values), less those that name or
    place the run or what it writes (plot.NOT_LABELS, the flags that do not split seeds of one setting)."""
    script = Path(cmd[1]).stem
    flags = bookkeeping.flat_args(tyro.cli(importlib.import_module(script).Args, args=cmd[2:]))
    flags = {k: v for k, v in flags.items() if k not in NOT_LABELS}
    return json.loads(json.dumps({"script": script, **flags}, default=str))


def same_run_elsewhere(out_dir: Path, cmd: list[str]) -> Path | None:
    """A finished run of another experiment of the scale with the command's training flags and seed (the CPU
    GRPO run is both `algorithms`' grpo and `group-size`'s G2): running it again would compute the same updates.
    As in the figures' seeds of one setting, the code version and the warm start's record are not compared."""
    wanted = training_flags(cmd)
    for folder in sorted(out_dir.parent.glob("*/*__*/args.json")):
        folder = folder.parent
        if (folder.parent == out_dir or folder.parent.name not in EXPERIMENTS  # not pilots, nor a folder of the user's
                or folder.is_symlink() or folder.parent.is_symlink()):
            continue
        saved = bookkeeping.read_json_object(folder / "args.json")
        if all(k in saved and saved[k] == v for k, v in wanted.items()) and finished(folder) and not in_use(folder):
            return folder
    return None


def link_run(link: Path, earlier: Path, dry_run: bool) -> None:
    """Count a finished run of another experiment as this variant's: a relative link, so that a clone keeps it."""
    print(f"study: {link.name} is the run {earlier} (the same flags and seed): "
          f"{'would link' if dry_run else 'linked'} as {link}, not run again", file=sys.stderr)
    if not dry_run:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(earlier, link.parent), target_is_directory=True)


def run_folders(out_dir: Path, variant: str, seed: int = 1) -> list[Path]:
    """The variant's run folders for one seed, oldest first (links to another experiment's run count)."""
    if not out_dir.is_dir():
        return []
    return sorted((p for p in out_dir.glob(f"{variant}__{seed}__*") if (p / "args.json").is_file()),
                  key=lambda p: p.name.split("__")[-1])


def last_step(rows: list[dict]) -> int:
    return max((row["step"] for row in rows), default=0)


def steps_logged(folder: Path) -> int:
    return last_step(read_rows(folder)) if (folder / "metrics.jsonl").is_file() else 0


def finished(folder: Path, rows: list[dict] | None = None) -> bool:
    """Did the run log every step its args.json asks for (`num_steps`, which every script writes)? `rows`: its
    metrics, when already read."""
    num_steps = bookkeeping.read_json_object(folder / "args.json").get("num_steps")
    logged = steps_logged(folder) if rows is None else last_step(rows)
    return bool(num_steps) and logged >= num_steps


def not_a_start(folder: Path) -> list[str]:
    """What the folder holds beyond what a run writes before its first step (its own files: args, the step-0
    evaluation, the empty samples file, the lock, the W&B id; event files), each a plain file. Anything else
    (an evaluation, a link) is someone's data."""
    return sorted(p.name for p in folder.iterdir()
                  if not ((p.name in bookkeeping.RUN_FILES or p.name.startswith("events.out.tfevents."))
                          and p.is_file() and not p.is_symlink()))


def run_state(out_dir: Path, variant: str, num_steps: int, seed: int = 1,
              dry_run: bool = False) -> tuple[str, Path | None]:
    """`finished` (its metrics reached num_steps), `resumable` (a checkpoint to go on from) or `new`. A
    folder of the variant that is neither and logged no training step (stopped at its start) is removed, not
    in a dry run, so that the new run does not stand beside it: one folder per variant and seed. One that
    logged steps but holds no checkpoint (killed before its first, or its checkpoints deleted, as a clone's
    committed runs have none) holds results that cannot tell which: refused, for the user to move."""
    for folder in reversed(run_folders(out_dir, variant, seed)):
        logged = steps_logged(folder)
        if logged >= num_steps:
            return "finished", folder
        if folder.is_symlink():  # another experiment's run (link_run): never continued from here
            raise common.ConfigError(
                f"{folder} cannot be continued to step {num_steps}: it is a link to {folder.resolve()}, which logged "
                f"{logged} steps; remove the link (not what it names) to run {variant} seed {seed} here anew")
        if bookkeeping.complete_checkpoints(folder):
            return "resumable", folder
        if in_use(folder):
            continue
        if logged > 0:
            raise common.ConfigError(
                f"{folder} cannot be continued to step {num_steps}: it logged {logged} steps and holds no checkpoint; "
                f"move it out of {out_dir} to run {variant} seed {seed} anew, or ask for at most {logged} steps "
                f"(--steps)")
        if extra := not_a_start(folder):
            raise common.ConfigError(
                f"{folder} cannot be continued to step {num_steps}: it logged no step, but holds {', '.join(extra)} "
                f"besides a run's own files; move it out of {out_dir} to run {variant} seed {seed} anew")
        if dry_run:
            print(f"study: would remove {folder}, a run stopped before its first step", file=sys.stderr)
            continue
        print(f"study: removing {folder}, a run stopped before its first step", file=sys.stderr)
        shutil.rmtree(folder)
    return "new", None


FINAL_EVAL = "final_eval.jsonl"
"""evaluate.py's record of a finished run's last checkpoint: scores, baselines, accuracy per operator class"""
FINAL_DETAILS = "final_eval_details.jsonl"
"""one line per held-out task: the greedy completion, the right and the chosen operators (git keeps both)"""


def final_evaluations(args: Args, experiment: str) -> list[tuple[str, list[str]]]:
    """evaluate.py on each finished run without its FINAL_EVAL: the per-operator table behind the study's
    claims about what the policy chooses (a run's last checkpoint is kept for this)."""
    out_dir = Path(args.root) / args.scale / experiment
    if args.dry_run or not out_dir.is_dir():
        return []
    commands = []
    for folder in sorted(p for p in out_dir.glob("*__*") if (p / "args.json").is_file()):
        if folder.is_symlink() or (folder / FINAL_EVAL).is_file() or not bookkeeping.complete_checkpoints(folder):
            continue  # a link's run is evaluated by the experiment that holds it
        if finished(folder):
            commands.append((f"evaluate {folder.name}", [sys.executable, str(ROOT / "evaluate.py"), str(folder),
                                                         "--out", str(folder / FINAL_EVAL),
                                                         "--details", str(folder / FINAL_DETAILS)]))
    return commands


def in_use(folder: Path) -> bool:
    """Does a live process hold the run's lock (a run still going)?"""
    try:
        fd = os.open(folder / ".lock", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def wall_minutes(rows: list[dict]) -> float:
    """The run's training and evaluation time, from its own logged times (not file dates: a clone has new ones);
    a missing or non-finite time (a hand-edited file) counts as none rather than making the total nan."""
    return sum(row[key] for row in rows for key in ("time/step", "time/eval")
               if math.isfinite(row.get(key, math.nan))) / 60


Runs = dict[str, list[tuple[Path, list[dict]]]]
"""variant -> its run folders with their metrics rows"""


def variant_key(experiment: str):
    """Sort key of a variant name: the order EXPERIMENTS lists the experiment's variants in (a sweep's order, beta 0
    before 0.0075), then any other name alphabetically."""
    order = [variant for variant, _, _ in EXPERIMENTS.get(experiment, ("", []))[1]]
    return lambda name: (order.index(name) if name in order else len(order), name)


def variant_runs(out_dir: Path) -> Runs:
    """Each variant's run folders under out_dir (`<variant>__<seed>__<time>`) with their metrics rows, variants in
    the experiment's order (variant_key)."""
    variants: Runs = {}
    for folder in sorted(p for p in out_dir.glob("*__*") if (p / "metrics.jsonl").is_file()):
        variants.setdefault(folder.name.split("__")[0], []).append((folder, read_rows(folder)))
    return {name: variants[name] for name in sorted(variants, key=variant_key(out_dir.name))}


def summary_table(runs_of: Runs) -> str:
    """One markdown row per variant of `runs_of` (variant_runs), over its seeds (mean, and min-max when there are
    several): held-out greedy accuracy at step 0 and at the end beside the best constant answer and a uniform guess on
    the same tasks, the final gain over the best constant, the share of groups whose rewards were all equal
    (zero advantage: no reward signal from them) over all steps, the last update's entropy (a DAPO step whose
    dynamic sampling found no informative group makes none) and the last step's length, seconds per step and wall
    time (logged)."""
    lines = ["| run | seeds | steps | best constant | uniform guess | acc step 0 | final acc | min-max | "
             "gain over constant | equal-reward groups | entropy at the end | length at the end | s/step "
             "| wall (per seed) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    variants: dict[str, list[list[dict]]] = {}
    for name, runs in runs_of.items():
        evaluated = [rows for _, rows in runs
                     if any("charts/eval_accuracy" in r for r in rows) and any(r["step"] >= 1 for r in rows)]
        if evaluated:
            variants[name] = evaluated
    for name, runs in variants.items():
        evals = [[r for r in rows if "charts/eval_accuracy" in r] for rows in runs]
        final = [e[-1]["charts/eval_accuracy"] for e in evals]
        constant = evals[0][0].get("charts/eval_best_constant", float("nan"))
        guess = evals[0][0].get("charts/eval_uniform_guess", float("nan"))
        train = [[r for r in rows if r["step"] >= 1] for rows in runs]
        step_times = [r["time/step"] for t in train for r in t]
        equal = [r["charts/zero_std_fraction"] for t in train for r in t if "charts/zero_std_fraction" in r]
        lines.append(
            f"| {name} | {len(runs)} | {min(t[-1]['step'] for t in train)} | {constant:.3f} | {guess:.3f} | "
            f"{fmean([e[0]['charts/eval_accuracy'] for e in evals]):.3f} | {fmean(final):.3f} | "
            f"{min(final):.3f}-{max(final):.3f} | {fmean(final) - constant:+.3f} | "
            f"{f'{fmean(equal):.3f}' if equal else '-'} | "
            f"{fmean([last_logged(t, 'losses/entropy') for t in train]):.3f} | "
            f"{fmean([t[-1]['charts/response_length'] for t in train]):.1f} | {median(step_times):.0f} | "
            f"{fmean([wall_minutes(rows) for rows in runs]):.0f} min |")
    return "\n".join(lines)


def last_logged(rows: list[dict], metric: str) -> float:
    """The metric's value at the last step that logged it (nan if none did)."""
    return next((r[metric] for r in reversed(rows) if metric in r), float("nan"))


def percent(fraction: float) -> str:
    """72/128 = 0.5625 as 56.3%, half up as people round (format() gives 56.2%, half to even)"""
    exact = decimal.Decimal(repr(fraction)) * 100  # the float's shortest repr: 201/400 is 50.25, not 50.2499...
    return f"{exact.quantize(decimal.Decimal('0.1'), rounding=decimal.ROUND_HALF_UP)}%"


def eval_step_table(runs_of: Runs, per_seed: bool = False) -> str:
    """Held-out greedy accuracy at each evaluation step, one row per variant: the mean over its seeds, with
    min-max and the number of seeds when it has several (a seed stopped early counts where it got to). With
    `per_seed`, one row per run instead, and below them each variant's baselines on the same tasks."""
    variants = {name: [[r for r in rows if "charts/eval_accuracy" in r] for _, rows in runs]
                for name, runs in runs_of.items()}
    steps = sorted({r["step"] for evals in variants.values() for e in evals for r in e})
    if not steps:
        return ""
    lines = ["| run | " + " | ".join(f"step {step}" for step in steps) + " |", "|---|" + "---|" * len(steps)]
    if per_seed:
        baselines = {}
        for name, runs in runs_of.items():
            for folder, rows in runs:
                evals = {r["step"]: r for r in rows if "charts/eval_accuracy" in r}
                cells = [percent(evals[step]["charts/eval_accuracy"]) if step in evals else "" for step in steps]
                lines.append(f"| {name}, seed {folder.name.split('__')[1]} | " + " | ".join(cells) + " |")
                first = next(iter(evals.values()), {})
                for key, label in (("charts/eval_best_constant", "best constant answer"),
                                   ("charts/eval_uniform_guess", "uniform guess")):
                    if key in first:
                        baselines.setdefault((label, first[key]), []).append(name)
        # one row per baseline value, best constants first: the variants evaluated on the same tasks share it
        for (label, value), names in sorted(baselines.items(), key=lambda kv: kv[0][0]):
            blanks = " |" * (len(steps) - 1)  # the same tasks at every step
            lines.append(f"| {label} ({', '.join(dict.fromkeys(names))}) | {percent(value)} |{blanks}")
        return "\n".join(lines)
    for name, evals in variants.items():
        cells = []
        for step in steps:
            values = [r["charts/eval_accuracy"] for e in evals for r in e
                      if r["step"] == step and math.isfinite(r["charts/eval_accuracy"])]
            cells.append("" if not values else percent(fmean(values)) if len(evals) == 1 else
                         f"{percent(fmean(values))} ({percent(min(values))}-{percent(max(values))}, n={len(values)})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def independence_p(by_class: dict, exact: bool | None = None, permutations: int = 9999, seed: int = 0) -> float:
    """p-value of the null "the chosen operator does not depend on the right one", from evaluate.py's
    by_operator_class counts: a permutation test of the contingency table's chi-square (the right operators
    shuffled over the tasks, both margins fixed). `exact` (the default for two classes) sums the probability of
    every table with those margins; otherwise 9,999 random shuffles estimate it (the smallest p is then
    1 / 10,000). For a 2 x 2 table with classes of equal size this is Fisher's two-sided exact test."""
    table = {cls: {op: n for op, n in entry["chosen"].items() if n > 0} for cls, entry in by_class.items()}
    table = {cls: chosen for cls, chosen in table.items() if chosen}
    ops = sorted({op for chosen in table.values() for op in chosen})
    if len(table) < 2 or len(ops) < 2:
        return 1.0  # one class or one answer: nothing to depend on
    rows = [sum(chosen.values()) for chosen in table.values()]
    cols = [sum(chosen.get(op, 0) for chosen in table.values()) for op in ops]
    if exact if exact is not None else len(table) == 2:
        return _two_class_exact_p([[chosen.get(op, 0) for op in ops] for chosen in table.values()], cols)
    right = [cls for cls, chosen in table.items() for n in chosen.values() for _ in range(n)]
    chosen_ops = [op for chosen in table.values() for op, n in chosen.items() for _ in range(n)]
    weight = {(cls, op): 1 / (r * c) for cls, r in zip(table, rows) for op, c in zip(ops, cols)}

    def statistic(labels: list[str]) -> float:  # chi-square / N + 1: monotone in chi-square at fixed margins
        return sum(n * n * weight[cell] for cell, n in Counter(zip(labels, chosen_ops)).items())

    observed, shuffled, rng = statistic(right), list(right), random.Random(seed)
    hits = 0
    for _ in range(permutations):
        rng.shuffle(shuffled)
        hits += statistic(shuffled) >= observed - 1e-12  # the same table summed in another order
    return (hits + 1) / (permutations + 1)


def _two_class_exact_p(table: list[list[int]], cols: list[int]) -> float:
    """independence_p for two classes, exactly: every first row with the column sums `cols`, weighted by its
    hypergeometric count, in exact fractions (no ties lost to rounding)."""
    first_total, second_total = sum(table[0]), sum(table[1])

    def statistic(first: list[int]) -> Fraction:
        return sum(Fraction(a * a, first_total * c) + Fraction((c - a) ** 2, second_total * c)
                   for a, c in zip(first, cols))

    def first_rows(i: int, left: int):
        if i == len(cols) - 1:
            if left <= cols[i]:
                yield [left]
            return
        for a in range(max(0, left - sum(cols[i + 1:])), min(cols[i], left) + 1):
            for rest in first_rows(i + 1, left - a):
                yield [a, *rest]

    observed = statistic(table[0])
    ways = sum(math.prod(math.comb(c, a) for a, c in zip(first, cols))
               for first in first_rows(0, first_total) if statistic(first) >= observed)
    return ways / math.comb(first_total + second_total, first_total)


def class_uniform_guesses(details: Path) -> dict:
    """{right operator class: a random template's accuracy on that class's tasks}, from a run's FINAL_DETAILS
    (final evaluations written before evaluate.py recorded it per class); {} without the file."""
    if not details.is_file():
        return {}
    rows = [json.loads(line) for line in details.read_text().splitlines() if line.strip()]
    return {cls: entry["uniform_guess"] for cls, entry in evaluate.by_operator_class(rows).items()
            if "uniform_guess" in entry}


def operator_table(out_dir: Path) -> str:
    """From each run's FINAL_EVAL: held-out greedy accuracy per operator class of the right answer, which
    operators the policy chose for it, and (on the run's first row) independence_p: small when the choice
    depends on the right operator, as it does for a policy that reads the target."""
    lines = ["| run | right operator | tasks | accuracy | uniform guess on them | chosen (count) "
             "| p (null: choice independent of it) |", "|---|---|---|---|---|---|---|"]
    key = variant_key(out_dir.name)
    for folder in sorted(out_dir.glob(f"*__*/{FINAL_EVAL}"), key=lambda f: (key(f.parent.name.split("__")[0]),
                                                                           f.parent.name)):
        rows = [json.loads(line) for line in folder.read_text().splitlines() if line.strip()]
        by_class = (rows[-1].get("by_operator_class") or {}) if rows else {}
        guess = class_uniform_guesses(folder.parent / FINAL_DETAILS)
        for i, (cls, entry) in enumerate(by_class.items()):
            chosen = ", ".join(f"{chosen_name(op)} {n}" for op, n in sorted(entry["chosen"].items(),
                                                                          key=lambda kv: -kv[1]))
            p = f"{independence_p(by_class):.2g}" if i == 0 else ""
            uniform = entry.get("uniform_guess", guess.get(cls))
            lines.append(f"| {folder.parent.name} | `{cls}` | {entry['tasks']} | {entry['accuracy']:.3f} | "
                         f"{'' if uniform is None else f'{uniform:.3f}'} | {chosen} | {p} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def chosen_name(operators: str) -> str:
    """How the operator table names a class of chosen answer (evaluate.answer_operators' codes)."""
    return {"": "no operator", "none": "no answer"}.get(operators, f"`{operators}`")  # "": a lone number


@dataclass(frozen=True)
class Finding:
    """A direction the paper reports: variant `higher` ends above variant `lower` on `metric`."""
    claim: str
    higher: str
    lower: str
    metric: str = "charts/eval_accuracy"


# experiment -> the paper's findings this study can check in finished runs: held-out greedy accuracy at the last
# evaluation, or, where the paper's finding is about a training quantity, its mean over the last TAIL steps
FINDINGS = {
    # Table 3 ranks accuracy on four benchmarks after Countdown training; here it is Countdown held-out accuracy
    "algorithms": (
        Finding("Table 3: DAPO without dynamic sampling is the most effective algorithm (above PPO)", "dapo", "ppo"),
        Finding("Table 3: DAPO without dynamic sampling is the most effective algorithm (above GRPO)", "dapo",
                "grpo"),
        Finding("Table 4: token-level DAPO has longer responses than GRPO", "dapo", "grpo",
                "charts/response_length")),
    "entropy": (
        Finding("Fig. 3(c): adding an entropy bonus leads to lower accuracy", "ent-0", "ent-0.001"),
        Finding("Fig. 3(a): the entropy bonus increases the fraction of clipped tokens", "ent-0.001", "ent-0",
                "losses/clipfrac"),
        Finding("Fig. 3(b): the entropy bonus increases the KL divergence between the new and old policies",
                "ent-0.001", "ent-0", "losses/approx_kl"),
        Finding("Section 3.1: the entropy bonus increases the KL divergence to the reference policy", "ent-0.001",
                "ent-0", "losses/kl_ref")),
    "learning-rate": (
        Finding("Fig. 4 (GSM8k there, Countdown held-out here): a larger learning rate achieves higher accuracy "
                "(with larger fluctuations)", "lr-10x", "lr-base"),
        Finding("Fig. 4(a): a higher learning rate causes the policy entropy to decay more rapidly", "lr-base",
                "lr-10x", "losses/entropy")),
    "group-size": (  # G = 4 outperforms G = 2 and G = 8 adds little: the conclusion compares G = 8 with G = 2
        Finding("Fig. 5: a larger group size G leads to better model accuracy", "G8", "G2"),
        Finding("Fig. 5: training with G = 4 outperforms G = 2", "G4", "G2"),
        Finding("Fig. 5: training with G = 4 outperforms G = 2, here at G = 2's completions per step (8 prompts x 4; "
                "the paper fixes the prompts)", "G4-same-completions", "G2"),
        Finding("Fig. 5: a larger group size G leads to better model accuracy, here G = 8 at G = 2's completions per "
                "step (4 prompts x 8)", "G8-same-completions", "G2"),
        Finding("Fig. 5(b): a smaller G leads to higher KL divergence to the reference policy", "G2", "G8",
                "losses/kl_ref"),
        Finding("Fig. 5(b): a smaller G leads to higher KL divergence to the reference policy, here G = 8 at G = 2's "
                "completions per step", "G2", "G8-same-completions", "losses/kl_ref"),
        Finding("Fig. 5(b): a smaller G leads to higher KL divergence to the reference policy, here G = 4 against "
                "G = 2", "G2", "G4", "losses/kl_ref")),
    "kl": (  # beta = 0.0075 and 0.01 are both "the best", 0.04 the worst; 0.01 is GRPO's default here
        Finding("Fig. 6(a): a moderate beta yields the best accuracy; beta = 0.04 significantly degrades it",
                "beta-0.01", "beta-0.04"),
        Finding("Fig. 6(a): further reducing beta (to 0 here) does not improve accuracy", "beta-0.01", "beta-0.0"),
        Finding("Fig. 6(b): as beta increases, the KL divergence to the reference policy decreases", "beta-0.0075",
                "beta-0.04", "losses/kl_ref"),  # beta = 0 loads no reference model: no KL logged
        Finding("Fig. 6(c), section 3.7: as beta decreased, GRPO generated shorter responses", "beta-0.04",
                "beta-0.0075", "charts/response_length"),
        Finding("Fig. 6(d): smaller KL coefficients correspond to larger policy gradient magnitudes", "beta-0.0075",
                "beta-0.04", "losses/grad_norm"),
        Finding("Fig. 6(d): smaller KL coefficients correspond to larger policy gradient magnitudes (beta 0 here)",
                "beta-0.0", "beta-0.04", "losses/grad_norm")),
    "loss-aggregation": (
        Finding("Section 3.4: the token-level loss consistently yields longer responses", "token-level",
                "sample-level", "charts/response_length"),),
    "dynamic-sampling": (
        Finding("Fig. 7(a): once accuracy peaks, dynamic sampling hinders further improvement", "no-ds", "ds"),
        Finding("Fig. 7(b): dynamic sampling achieves a higher surrogate objective", "ds", "no-ds",
                "losses/surrogate"),
        Finding("Section 3.5: dynamic sampling adds computation time per training step (over 25% at G = 8)", "ds",
                "no-ds", "time/step")),
    "dapo-group-size": (  # G8 and G2-beta0 differ in G alone: DAPO's beta is 0
        Finding("Fig. 8(a): a larger group size leads to higher model accuracy", "G8", "G2-beta0"),
        Finding("Fig. 8(a): a larger group size leads to higher model accuracy, here G = 4 against G = 2", "G4",
                "G2-beta0"),
        # the caption's direction for panel (d); section 3.6 finds G = 2 without KL's gradient "much larger"
        Finding("Fig. 8(d) (caption): a larger group size leads to a higher policy gradient", "G8", "G2-beta0",
                "losses/grad_norm"),
        Finding("Fig. 8(d) (caption): a larger group size leads to a higher policy gradient, here G = 4 against "
                "G = 2", "G4", "G2-beta0", "losses/grad_norm"),
        Finding("Section 3.6: at G = 2 without the KL penalty, the model performs poorly", "G2-beta0.01",
                "G2-beta0"),
        Finding("Section 3.6: without the KL penalty at G = 2, the policy gradient is much larger", "G2-beta0",
                "G2-beta0.01", "losses/grad_norm"),
        Finding("Fig. 8(b): at G = 2 without KL, responses are noticeably shorter than with a KL penalty",
                "G2-beta0.01", "G2-beta0", "charts/response_length"),
        Finding("Fig. 8(b): at G = 2 without KL, responses are noticeably shorter than at larger group sizes", "G8",
                "G2-beta0", "charts/response_length"),
        Finding("Fig. 8(b): at G = 2 without KL, responses are noticeably shorter than at larger group sizes, here "
                "G = 4", "G4", "G2-beta0", "charts/response_length"),
        Finding("Fig. 8(c): at G = 2 without KL, the new policy deviates substantially from the old policy",
                "G2-beta0", "G2-beta0.01", "losses/approx_kl")),  # KL to pi_old: both run 2 minibatches a step
}


TAIL = 10
"""training quantities (KL, entropy, length...) swing from step to step: a finding reads their last TAIL steps' mean"""


def finished_values(runs: list[tuple[Path, list[dict]]], metric: str) -> list[float]:
    """One value per seed, of each finished run (its steps reached args.json's num_steps): the last evaluation's
    for an evaluation metric, else the mean of the last TAIL training steps."""
    by_seed = {}
    for folder, rows in runs:
        if metric.startswith("charts/eval_"):
            values = [r[metric] for r in rows if metric in r][-1:]
        else:
            values = [r[metric] for r in rows if metric in r and r["step"] >= 1][-TAIL:]
        if values and finished(folder, rows):
            by_seed[folder.name.split("__")[1]] = fmean(values)
    return list(by_seed.values())


def verdict(higher: list[float], lower: list[float]) -> str:
    """Does every seed of the side the paper finds higher beat every seed of the other?"""
    if min(len(higher), len(lower)) < 2:
        return "needs >= 2 seeds per side"
    if min(higher) > max(lower):
        return "held"
    if min(lower) > max(higher):
        return "opposite"
    return "not separable at this scale"


def permutation_p(higher: list[float], lower: list[float]) -> float:
    """Two-sided exact permutation test of the difference of means: of every way to deal the pooled seeds into
    sides of these sizes, the share whose difference is at least as large either way (seeds interchangeable).
    Sides of 3 and 3 seeds cannot go below 0.1 (the mirror split is as far apart), of 2 and 3 not below 0.1, of 2
    and 2 not below 0.33: it tells how much a clean separation of so few seeds shows. The verdict reads ranges, p
    means: 2 seeds cleanly below 3 may still give 0.2 (another split's means as far apart)."""
    pooled = higher + lower
    splits = list(combinations(range(len(pooled)), len(higher)))

    def difference(split: tuple[int, ...]) -> float:
        side = [pooled[i] for i in split]
        rest = [pooled[i] for i in range(len(pooled)) if i not in split]
        return abs(fmean(side) - fmean(rest))

    observed = difference(tuple(range(len(higher))))
    # other seeds with the same exact sum may round apart in the last bit: a relative tolerance keeps them ties
    return sum(difference(split) >= observed * (1 - 1e-9) for split in splits) / len(splits)


def seeds_cell(variant: str, values: list[float]) -> str:
    """A side of a finding: its mean, min-max and number of finished seeds."""
    if not values:
        return f"`{variant}` no finished run"
    return f"`{variant}` {fmean(values):.4g} ({min(values):.4g}-{max(values):.4g}, n={len(values)})"


def verdict_table(runs: Runs, experiment: str) -> str:
    """One markdown row per paper finding of the experiment: each side over its finished seeds, and the verdict."""
    lines = ["| paper's finding | metric | higher in the paper | lower in the paper | difference of means | p "
             "| verdict |",
             "|---|---|---|---|---|---|---|"]
    for finding in FINDINGS.get(experiment, ()):
        higher = finished_values(runs.get(finding.higher, []), finding.metric)
        lower = finished_values(runs.get(finding.lower, []), finding.metric)
        difference = f"{fmean(higher) - fmean(lower):+.4g}" if higher and lower else "-"
        p = f"{permutation_p(higher, lower):.2g}" if min(len(higher), len(lower)) >= 2 else "-"
        lines.append(f"| {finding.claim} | `{finding.metric}` | {seeds_cell(finding.higher, higher)} | "
                     f"{seeds_cell(finding.lower, lower)} | {difference} | {p} | {verdict(higher, lower)} |")
    return "\n".join(lines)


RUNG_FLAGS = ("task_min_numbers", "task_max_numbers", "task_max_value", "task_operators", "test_size", "eval_size")


def baseline_table(experiments: list[str], only: tuple[str, ...] = ()) -> str:
    """One markdown row per distinct rung among the experiments' CPU variants: the tasks each evaluation uses
    (load_countdown's held-out split, as the scripts draw it), by the operators of their hidden solution, and
    what answering without reading the target scores on them (common.constant_baselines)."""
    lines = ["| variants | rung (`--task-*`) | held-out tasks evaluated | by operators | best constant "
             "| uniform guess |",
             "|---|---|---|---|---|---|"]
    rungs: dict[tuple, list[str]] = {}
    for experiment in experiments:
        for variant, script, changes in EXPERIMENTS[experiment][1]:
            if not only or variant in only:
                flags = variant_flags("cpu", f"{experiment}/{variant}", script, changes)
                rungs.setdefault(tuple(flags[k] for k in RUNG_FLAGS), []).append(f"{experiment}/{variant}")
    for rung, names in rungs.items():
        low, high, max_value, operators, test_size, eval_size = rung
        whole = [e for e in experiments if all(f"{e}/{v}" in names for v, _, _ in EXPERIMENTS[e][1])]
        names = whole + [n for n in names if n.split("/")[0] not in whole]  # an experiment all on this rung: its name
        _, held_out = common.load_countdown("generated", test_size, seed=1, train_size=1, min_numbers=low,
                                            max_numbers=high, max_value=max_value, operators=operators)
        tasks = held_out[:eval_size]
        counts = Counter(common.operator_class(t) for t in tasks)
        by_class = ", ".join(f"`{c}` {n}" for c, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        constants = common.constant_baselines(tasks)
        # a template per number count, joined by |, which would end the markdown cell
        template = constants["best_constant_template"].replace("|", r"\|")
        lines.append(f"| {', '.join(names)} | {rung_name(dict(zip(RUNG_FLAGS, rung)))} | "
                     f"{len(tasks)} | {by_class} | {percent(constants['best_constant'])} "
                     f"(`{template}`) | {percent(constants['uniform_guess'])} |")
    return "\n".join(lines)


def shown(cmd: list[str]) -> str:
    """The command as a person would type it: `python grpo.py ...` from the repository root."""
    script = Path(cmd[1])
    return shlex.join(["python", str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else str(script)]
                      + cmd[2:])


def study_lock(out_dir: Path, root: str) -> FileLock:
    """One study at a time writes an experiment's folder."""
    return common.file_lock(out_dir / ".study.lock", f"--root={root!r}", timeout=0)


def main(args: Args) -> int:
    common.require(args.steps >= 0, "steps", args.steps, ">= 0 (0: the scale's default)")
    common.require(bool(args.seeds) and len(set(args.seeds)) == len(args.seeds), "seeds", list(args.seeds),
                   "one or more different integers")
    experiments = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    if args.scale == "paper":
        common.require(args.experiment not in CPU_ONLY, "experiment", args.experiment,
                       "a figure of the paper (`ladder` and `harder-rung` train on generated tasks: CPU scale only)")
        experiments = [e for e in experiments if e not in CPU_ONLY]
    known = {v for e in experiments for v, _, _ in EXPERIMENTS[e][1]}
    common.require(set(args.only) <= known, "only", list(args.only), f"variants of {args.experiment}: {sorted(known)}")
    if args.baselines:
        common.require(args.scale == "cpu", "scale", args.scale, "`cpu` with --baselines (the paper's held-out "
                       "tasks are the hub dataset's, which this machine may not have)")
        print(baseline_table(experiments, args.only))
        return 0
    if args.summary:
        for experiment in experiments:
            out_dir = Path(args.root) / args.scale / experiment
            runs = variant_runs(out_dir)  # read once for every table
            steps = eval_step_table(runs)
            steps = (f"Held-out greedy accuracy per evaluation step, each run\n\n{eval_step_table(runs, True)}\n\n"
                     f"and per variant\n\n{steps}\n\n") if steps else ""
            print(f"# {experiment}\n\n{summary_table(runs)}\n\n{steps}{operator_table(out_dir)}\n")
            if experiment in FINDINGS:
                print(f"## The paper's findings\n\n{verdict_table(runs, experiment)}\n")
        return 0
    for experiment in experiments:
        out_dir = Path(args.root) / args.scale / experiment
        if not args.dry_run:
            out_dir.mkdir(parents=True, exist_ok=True)
        lock = study_lock(out_dir, args.root) if not args.dry_run else contextlib.nullcontext()
        try:
            with lock:
                print(f"# {experiment}: {EXPERIMENTS[experiment][0]}", flush=True)
                for listed in (run_commands, final_evaluations):  # the runs, then the finished ones' evaluations
                    for variant, cmd in listed(args, experiment):
                        print("$ " + shown(cmd), flush=True)
                        if not args.dry_run and subprocess.run(cmd).returncode != 0:
                            print(f"study: {experiment}/{variant} failed; run the same command again to continue",
                                  file=sys.stderr)
                            return 1
        except Timeout:
            raise common.ConfigError(f"--root={args.root!r} is not allowed: another study is writing "
                                     f"{out_dir} (it holds {out_dir / '.study.lock'})") from None
        # the default panels, and a panel for each quantity a finding of the paper reads (its figure has it)
        extra = [f.metric for f in FINDINGS.get(experiment, ()) if f.metric not in DEFAULT_METRICS]
        metrics = ["--metrics", *DEFAULT_METRICS, *dict.fromkeys(extra)] if extra else []
        for suffix in (".png", ".pdf"):  # the README shows the PNG; a paper prints the PDF
            plot = [sys.executable, str(ROOT / "plot.py"), str(out_dir), "--out", str(out_dir) + suffix,
                    "--title", EXPERIMENTS[experiment][0].split(":")[0] + f" ({args.scale} scale)", *metrics]
            print("$ " + shown(plot), flush=True)
            if not args.dry_run and subprocess.run(plot).returncode != 0:
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_command(lambda: main(tyro.cli(Args))))
