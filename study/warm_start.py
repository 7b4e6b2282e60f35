"""A format-only warm start for the CPU study: supervised fine-tuning on well-formed answers that are
never correct, so that the model learns the `</think> <answer> ... </answer>` format and to use the
given numbers, but not how to reach the target. Off in the paper's configuration (the paper starts RL
from Qwen2.5-1.5B-Instruct itself); it exists because SmolLM2-135M-Instruct never writes a well-formed
answer on its own (0 of 448 samples), so every reward is equal and GRPO has no signal to start from.

Each training completion is `<think>`-prefilled text `I will try EXPR.</think>\\n<answer> EXPR </answer>`
where EXPR is a random expression over the task's numbers (each used once, random operators from +-*/,
random order), kept only if its value is NOT the target. Accuracy after the warm start is therefore the
chance rate of guessing; whatever rises above it during RL was learned from the reward.

    python study/warm_start.py --out runs/warm_start              # ~5 min on 2 CPU cores
    python grpo.py --model runs/warm_start ...
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Literal

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import countdown_reward  # noqa: E402


@dataclass
class Args:
    out: str = "runs/warm_start"
    """the folder to write the warmed-up model to (a plain HF folder: --model OUT)"""
    model: str = common.BUNDLED_MODEL
    """the model to warm up"""
    num_steps: int = 40
    """optimizer steps"""
    batch_size: int = 16
    """examples per step"""
    learning_rate: float = 3e-5
    """AdamW learning rate"""
    seed: int = 1
    """seed of the examples and their order"""
    task_min_numbers: int = 2
    """examples: fewest numbers per task"""
    task_max_numbers: int = 4
    """examples: most numbers per task"""
    task_max_value: int = 99
    """examples: numbers are drawn from 1..task_max_value"""
    prompt_template: Literal["auto", "chat", "base"] = "auto"
    """the prompt the RL runs will use (training's --prompt-template)"""


def wrong_answer(nums: list[int], target: int, rng: random.Random) -> str | None:
    """A random expression using every number once, whose value is not the target (None if none found)."""
    for _ in range(20):
        order = rng.sample(nums, len(nums))
        expr, value = str(order[0]), Fraction(order[0])
        for i, n in enumerate(order[1:], start=1):
            op = rng.choice("+-*/")
            value = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op]
            expr = f"{expr} {op} {n}" if i == len(order) - 1 else f"({expr} {op} {n})"
        text = f"</think> <answer> {expr} </answer>"
        if (value != target and countdown_reward.is_well_formed(text)
                and countdown_reward.uses_numbers_exactly(expr, nums)
                and not countdown_reward.is_correct(text, nums, target)):
            return expr
    return None


def examples(args: Args, count: int) -> list[dict]:
    rng = random.Random(args.seed)
    tasks = common.generate_tasks(count * 2, seed=10_000 + args.seed, min_numbers=args.task_min_numbers,
                                  max_numbers=args.task_max_numbers, max_value=args.task_max_value)
    out = []
    for task in tasks:
        expr = wrong_answer(task["nums"], task["target"], rng)
        if expr is not None:
            out.append({**task, "completion": f" I will try {expr}.</think>\n<answer> {expr} </answer>"})
    return out[:count]


def main(args: Args) -> str:
    common.check_finite(args)
    common.require(args.task_min_numbers >= 2, "task_min_numbers", args.task_min_numbers, ">= 2")
    common.require(args.task_max_numbers >= args.task_min_numbers, "task_max_numbers", args.task_max_numbers,
                   f">= --task-min-numbers ({args.task_min_numbers})")
    common.require(2 <= args.task_max_value <= 999, "task_max_value", args.task_max_value, "in [2, 999]")
    for name in ("num_steps", "batch_size"):
        common.require(getattr(args, name) >= 1, name, getattr(args, name), "a positive integer")
    common.require(args.learning_rate > 0, "learning_rate", args.learning_rate, "> 0")
    common.seed_everything(args.seed)
    path = common.resolve_model(args.model)
    tokenizer = common.load_tokenizer(path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = common.load_model(path, device, dtype=common.compute_dtype("auto", device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    data = examples(args, args.num_steps * args.batch_size)
    eos = tokenizer.eos_token
    start = time.perf_counter()
    for step in range(args.num_steps):
        batch = data[step * args.batch_size:(step + 1) * args.batch_size]
        prompts = [common.make_prompt(tokenizer, t, args.prompt_template) for t in batch]
        prompt_ids, prompt_mask = common.encode_prompts(tokenizer, prompts, 1, device)
        completion = tokenizer([t["completion"] + eos for t in batch], return_tensors="pt", padding=True,
                               padding_side="right", add_special_tokens=False).to(device)
        logprobs, _ = common.completion_logprobs(model, prompt_ids, prompt_mask, completion.input_ids,
                                                 completion.attention_mask)
        mask = completion.attention_mask.float()
        loss = -(logprobs * mask).sum() / mask.sum()  # mean negative log-likelihood of the answer tokens
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        print(f"step {step + 1}/{args.num_steps}  loss {loss.item():.3f}  {time.perf_counter() - start:.0f} s",
              flush=True)
    tmp = Path(args.out + ".tmp")
    model.save_pretrained(tmp)
    common.write_portable_config(tmp)
    tokenizer.save_pretrained(tmp)
    if os.path.isdir(args.out):
        import shutil

        shutil.rmtree(args.out)
    os.replace(tmp, args.out)
    print(f"warm-started model: {args.out}  (use --model {args.out})")
    return args.out


if __name__ == "__main__":
    common.exit_on_config_error(lambda: main(tyro.cli(Args)))
