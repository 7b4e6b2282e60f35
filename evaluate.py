"""Evaluate a model or checkpoint on the held-out Countdown split, with the prompt, template and reward
that training uses: greedy accuracy and format rate, and with --samples pass@k and the sampled format rate.

    python evaluate.py runs/grpo__1__1764000000                  # a run: its newest checkpoint, its data
    python evaluate.py runs/grpo__1__1764000000/checkpoint-100   # one checkpoint of a run
    python evaluate.py bundled                                   # a model: the base rate (step 0)
    python evaluate.py Qwen/Qwen2.5-1.5B-Instruct --samples 8    # pass@1, 2, 4 and 8 at temperature 1
    torchrun --nproc_per_node=N evaluate.py ...                  # the tasks are sharded over processes

A run's data, task and prompt settings (its args.json) are used unless a flag is typed. Prints a table and
one JSON line (appended to --out when given).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

import bookkeeping

import common
import countdown_reward

# what a run's args.json decides unless typed: the held-out tasks and how they are put to the model
RUN_SETTINGS = ("dataset", "test_size", "task_min_numbers", "task_max_numbers", "task_max_value", "task_operators",
                "prompt_template", "max_new_tokens")


@dataclass
class Args:
    target: tyro.conf.Positional[str]
    """a run folder (its newest checkpoint), a checkpoint-<step> folder, a model folder, `bundled` or a hub id"""
    size: int = 0
    """held-out tasks to evaluate (0: all --test-size of them)"""
    samples: int = 0
    """completions sampled per task for pass@k at --temperature (0: greedy only)"""
    temperature: float = 1.0
    """sampling temperature of --samples (greedy decoding is always temperature 0)"""
    top_p: float = 1.0
    """nucleus sampling of --samples"""
    seed: int = 1
    """seed of the sampled completions"""
    out: str = ""
    """also append the JSON line to this file"""
    details: str = ""
    """also write one JSON line per held-out task to this file (replacing it): the task, the greedy completion,
    whether it was correct, the operators of the right answer and of the model's answer"""

    # The held-out tasks and the prompt: a run's own settings unless typed, else the training defaults
    dataset: str = "generated"
    """`generated`, a .jsonl/.parquet file with nums and target, or a hub id (Jiayi-Pan/Countdown-Tasks-3to4)"""
    test_size: int = 128
    """size of the held-out split (the same rows as training's --test-size)"""
    task_min_numbers: int = 2
    """generated tasks: fewest numbers per task"""
    task_max_numbers: int = 2
    """generated tasks: most numbers per task"""
    task_max_value: int = 20
    """generated tasks: numbers are drawn from 1..task_max_value"""
    task_operators: str = "+*"
    """generated tasks: operators the hidden solution may use"""
    prompt_template: Literal["auto", "chat", "base"] = "auto"
    """`auto`: the tokenizer's chat template when it has one, else TinyZero's plain base-model template"""
    max_new_tokens: int = 48
    """longest completion"""

    # Systems
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: CUDA when visible, else CPU"""
    compute_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """dtype of the forward (`auto`: bfloat16 on a GPU, float32 on a CPU)"""
    batch_size: int = 32
    """prompts per generate call"""
    backend: Literal["hf", "vllm"] = "hf"
    """generation backend: `hf` (transformers generate) or `vllm`"""
    vllm_gpu_memory_utilization: float = 0.8
    """--backend vllm on GPU: the share of GPU memory the engine may take"""
    vllm_kv_cache_gib: int = 4
    """--backend vllm on CPU: KV-cache size in GiB per process"""
    vllm_sleep_mode: bool = False
    """unused here (no training between generate calls); a field the vLLM backend reads"""


MAX_SAMPLES = 1024
"""completions per task at most: a task's samples are generated in one call, so they must fit in memory"""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c are correct (Chen et al., 2021):
    1 - C(n - c, k) / C(n, k), the chance that k of the n drawn without replacement hold a correct one."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def resolve_target(target: str) -> tuple[str, dict, int | None]:
    """(model folder or hub id, the run's saved args or {}, the checkpoint's step or None)."""
    path = Path(target)
    run_dir = path if (path / "args.json").is_file() else path.parent
    if path.is_dir() and (run_dir / "args.json").is_file():
        try:
            saved = json.loads((run_dir / "args.json").read_text())
            assert isinstance(saved, dict)
        except (OSError, ValueError, RecursionError, AssertionError):
            raise common.ConfigError(f"target={target!r}: {run_dir}/args.json is not a JSON object") from None
        if path == run_dir:  # a run folder: its newest checkpoint that reads back (its optimizer state unloaded)
            newest = bookkeeping.newest_intact_checkpoint(bookkeeping.complete_checkpoints(run_dir), load_state=False)
            if newest is None:
                raise common.ConfigError(f"target={target!r} is not allowed: the run has no intact checkpoint-<step> "
                                         f"folder (a run saves one every --save-every steps and at its end)")
            path = newest[0]
        elif path.name.startswith("checkpoint-") and path.name.endswith(".tmp"):
            raise common.ConfigError(f"target={target!r} is not allowed: a half-written checkpoint (its save was "
                                     f"interrupted); pass the run folder or a checkpoint-<step> folder")
        common.check_model_folder(str(path), "target")
        suffix = path.name.removeprefix("checkpoint-")
        return str(path), saved, int(suffix) if path.name != suffix and suffix.isascii() and suffix.isdigit() else None
    return common.resolve_model(target), {}, None


def check_args(args: Args) -> None:
    bookkeeping.check_finite(args)
    bookkeeping.check_task_args(args)
    common.require(args.size >= 0, "size", args.size, ">= 0")
    common.require(0 <= args.samples <= MAX_SAMPLES, "samples", args.samples,
                   f"in [0, {MAX_SAMPLES}] (each generate call holds one task's samples at once; "
                   f"pass@k needs k <= samples)")
    common.require(args.temperature > 0, "temperature", args.temperature, "> 0 (greedy is always evaluated)")
    common.require(0 < args.top_p <= 1, "top_p", args.top_p, "in (0, 1]")
    common.require(args.batch_size >= 1, "batch_size", args.batch_size, "a positive integer")
    common.require(args.max_new_tokens >= 1, "max_new_tokens", args.max_new_tokens, "a positive integer")
    common.require(args.test_size >= 1, "test_size", args.test_size, "a positive integer")
    common.require(args.size <= args.test_size, "size", args.size, f"at most --test-size ({args.test_size})")


def sampled_scores(backend, tokenizer, tasks: list[dict], args: Args, world: common.Dist) -> dict:
    """Accuracy and format rate of every sampled completion, and pass@k for k = 1, 2, 4, ... up to --samples."""
    mine, padded = common.shard_tasks(tasks, world)
    batch = max(1, args.batch_size // args.samples)
    ks = sorted({2**i for i in range(int(math.log2(args.samples)) + 1)} | {args.samples})
    totals = [0.0] * (2 + len(ks))  # accuracy, pass@k..., format rate
    for i in range(0, len(padded), batch):
        chunk = padded[i:i + batch]
        rollout = backend.generate([common.make_prompt(tokenizer, t, args.prompt_template) for t in chunk],
                                   args.samples, args.max_new_tokens, args.temperature, args.top_p,
                                   seed=common.generation_seed(args.seed, 0, world.rank, batch=i))
        real = max(0, min(len(chunk), len(mine) - i))
        group_tasks = [t for t in chunk[:real] for _ in range(args.samples)]
        _, correct, well_formed = common.countdown_rewards(rollout.texts[:len(group_tasks)], group_tasks, 0.0, 1.0)
        totals[-1] += sum(well_formed) / args.samples
        for g in range(real):
            c = int(sum(correct[g * args.samples:(g + 1) * args.samples]))
            totals[0] += c / args.samples
            for j, k in enumerate(ks):
                totals[1 + j] += pass_at_k(args.samples, c, k)
    totals = common.all_reduce_sum(totals, world)
    n = max(len(tasks), 1)
    return {"sampled_accuracy": totals[0] / n, "sampled_format_rate": totals[-1] / n,
            **{f"pass@{k}": totals[1 + j] / n for j, k in enumerate(ks)}}


def answer_operators(text: str) -> str:
    """The operators of a completion's answer, sorted (`+`, `-*`; empty for a lone number), or `none` without a
    well-formed answer."""
    answer = countdown_reward.extract_answer(text) if countdown_reward.is_well_formed(text) else None
    return common.expression_operators(answer) if answer is not None else "none"


def by_operator_class(details: list[dict]) -> dict:
    """Greedy accuracy per operator class of the right answer, and how often each class of answer was
    chosen for it: {right class: {"tasks": n, "accuracy": a, "chosen": {chosen class: count}}}, with the
    uniform guess's accuracy on the class's own tasks (`uniform_guess`) where the rows hold their tasks."""
    rows_of: dict[str, list[dict]] = {}
    for row in details:
        rows_of.setdefault(row["operator_class"], []).append(row)
    table = {}
    for cls, rows in sorted(rows_of.items()):
        chosen: dict[str, int] = {}
        for row in rows:
            chosen[row["chosen_operators"]] = chosen.get(row["chosen_operators"], 0) + 1
        table[cls] = {"tasks": len(rows), "accuracy": sum(row["correct"] for row in rows) / len(rows),
                      "chosen": dict(sorted(chosen.items())), **class_uniform_guess(rows)}
    return table


def class_uniform_guess(rows: list[dict]) -> dict:
    """{"uniform_guess": a random template's accuracy on these tasks}, or {} when a row lacks its task or a
    task has too many numbers for the baselines."""
    if not all("nums" in row and "target" in row for row in rows):
        return {}
    baselines = common.constant_baselines(rows)
    return {"uniform_guess": baselines["uniform_guess"]} if baselines else {}


def writable_file(path: str, flag: str) -> None:
    """Checked before the evaluation, so that a bad path does not waste it: its folder exists and takes files,
    and it is not a link (written through, it would change a file elsewhere)."""
    folder = os.path.dirname(os.path.abspath(path))
    common.require(os.path.isdir(folder), flag, path, "a file in an existing folder")
    common.require(not os.path.islink(path), flag, path, "a file, not a symbolic link")
    common.require(not os.path.exists(path) or os.path.isfile(path), flag, path, "a regular file, not a folder, "
                   "pipe or device")
    common.require(os.access(folder, os.W_OK) and (not os.path.exists(path) or os.access(path, os.W_OK)), flag,
                   path, "a file this user may write")


def same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b) or (
        os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))  # hard links too


def check_outputs(out: str, details: str) -> None:
    """--out and --details, before the evaluation: each writable_file, and two different files."""
    for flag, path in (("out", out), ("details", details)):
        if path:
            writable_file(path, flag)
    # --details replaces its file: the same file as --out would lose the records appended to it
    common.require(not (out and details and same_file(out, details)), "details", details, "another file than --out")
    longest = 255 - bookkeeping.TEMPORARY_NAME_EXTRA  # it is written under a longer temporary name first
    common.require(len(os.fsencode(os.path.basename(details))) <= longest, "details", details,
                   f"a file name of at most {longest} bytes")


def main(args: Args, typed: set[str]) -> dict:
    model_path, run_args, step = resolve_target(args.target)
    for name in RUN_SETTINGS:  # the run's held-out split and prompt, unless a flag was typed
        if name in run_args and name not in typed:
            setattr(args, name, run_args[name])
    check_args(args)
    check_outputs(args.out, args.details)
    world = common.setup_distributed(args.device)
    _, test_tasks = common.load_countdown(
        args.dataset, args.test_size, run_args.get("seed", 1), min_numbers=args.task_min_numbers,
        max_numbers=args.task_max_numbers, max_value=args.task_max_value, operators=args.task_operators)
    tasks = test_tasks[:args.size or None]
    tokenizer = common.load_tokenizer(model_path)
    dtype = common.compute_dtype(args.compute_dtype, world.device)
    model = common.load_model(model_path, world.device, trainable=False, dtype=dtype)
    backend = common.make_backend(args.backend, model, tokenizer, args, args, args.seed, model_path, world, tasks)

    if world.is_main:  # the cost up front: a 1,024-task, 8-sample evaluation runs for hours on a laptop CPU
        print(f"evaluating {len(tasks)} tasks x {1 + args.samples} completions of up to {args.max_new_tokens} "
              f"tokens on {world.device} ({world.world_size} process{'es' if world.world_size > 1 else ''})",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    details: list[dict] = []
    greedy = common.evaluate(backend, tokenizer, tasks, args.max_new_tokens, world, args.prompt_template,
                             args.batch_size, details)
    details = common.gather_objects(details, world)
    for row in details:
        row.update(operator_class=common.operator_class(row) if "solution" in row else "?",
                   chosen_operators=answer_operators(row["completion"]))
    result = {"target": args.target, "model": model_path, "step": step, "tasks": len(tasks),
              "dataset": args.dataset, "max_new_tokens": args.max_new_tokens,
              "greedy_accuracy": greedy["charts/eval_accuracy"], "format_rate": greedy["charts/eval_format_rate"],
              "response_length": greedy["charts/eval_response_length"], "code_version": bookkeeping.code_version()}
    if "charts/eval_best_constant" in greedy:  # what answering without reading the target scores
        constants = common.constant_baselines(tasks)
        result.update(best_constant=greedy["charts/eval_best_constant"],
                      best_constant_template=constants["best_constant_template"],
                      best_constant_by_operators=constants["best_by_operators"],
                      uniform_guess=greedy["charts/eval_uniform_guess"],
                      gain_over_best_constant=greedy["charts/eval_accuracy"] - greedy["charts/eval_best_constant"])
    if all(row["operator_class"] != "?" for row in details):
        result["by_operator_class"] = by_operator_class(details)
    if args.samples:
        result.update(samples=args.samples, temperature=args.temperature,
                      **sampled_scores(backend, tokenizer, tasks, args, world))
    result["seconds"] = round(time.perf_counter() - start, 1)
    if world.is_main:
        width = max(len(k) for k in result)
        for key, value in result.items():
            print(f"{key:<{width}}  {value:.4f}" if isinstance(value, float) else f"{key:<{width}}  {value}",
                  file=sys.stderr)
        print(json.dumps(result), flush=True)
        if args.out:  # neither is written through a link
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
            with os.fdopen(bookkeeping.open_run_file(Path(args.out), flags, "--out"), "a") as f:
                f.write(json.dumps(result) + "\n")
        if args.details:
            bookkeeping.write_run_file(Path(args.details), [json.dumps(row) + "\n" for row in details], "--details")
    backend.close()
    common.cleanup_distributed()
    return result


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    common.run_command(lambda: main(tyro.cli(Args), bookkeeping.typed_flags(sys.argv[1:])))
