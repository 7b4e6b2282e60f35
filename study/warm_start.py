"""A format-only warm start for the bundled model: supervised fine-tuning on well-formed answers whose
expression is drawn without looking at the target, so that the model learns the format
(`... </think>\\n<answer> EXPR </answer>`), to restate the target and to use each given number once,
but nothing about which expression is right. Off in the paper's configuration (the paper starts RL from
Qwen2.5-1.5B-Instruct); it exists because SmolLM2-135M-Instruct almost never writes a well-formed answer
on its own (1 of 512 samples of 48 tokens on the CPU rung, none right: study/README.md), so nearly every
reward is equal and GRPO has nothing to learn from.

Each example is a task of 2-4 numbers from 21..99 (disjoint from every CPU rung whose numbers are at most
20: all but the ladder's rung 5) and the completion ` The target is T. I will try EXPR.</think>\\n<answer>
EXPR </answer>`, where
EXPR writes the numbers largest first (a convention, so that a difference is never negative) joined left
to right by operators drawn uniformly from --operators. EXPR is right only by chance, and which operator
it uses is independent of which one is right, so the model learns the format, not the answer. (With the
numbers in random order, `+` was right twice as often as `-` on a two-number task, RL reinforced `+` on
every prompt and the policy collapsed to "always add": study/README.md, pilots.) The held-out tasks of
the task settings given (--task-* flags, --test-size) are never among the examples.

`--trace search` writes ` The target is T. Try E1 = V1. Try E2 = V2. I will try E2. ...`: 1 to --max-tries
random expressions, each with its exact value, and the answer is the last one tried. How many tries there
are is drawn before any is written, so a try that hits the target is followed by another as often as one
that misses: the model learns to write values out; when to stop, and so which answer, is left to RL.

    python study/warm_start.py --out runs/warm_start     # about 7 min on 2 CPU cores
    python grpo.py --model runs/warm_start ...
    python grpo.py --model bundled-warm ...              # the same, made once per machine and cached
    python study/warm_start.py --labels-only             # its examples' answers by the right operator; no training

--out must not exist, or hold an earlier warm start (its warm_start.json and model files, nothing else): nothing
else is overwritten.
The folder is written beside --out and renamed into place under a lock.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Literal

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bookkeeping  # noqa: E402
import common  # noqa: E402
import countdown_reward  # noqa: E402

MARKER = bookkeeping.WARM_START_RECORD
"""the file that says a folder was written by this script (its settings, code version, weights' SHA-256 and files);
only such a folder is replaced, and a run started from the folder copies it into its args.json (`model_source`)"""
MIN_VALUE = 21
"""the examples' numbers are drawn from 21..99: no CPU rung with numbers up to 20 shares a task with them"""


@dataclass
class Args:
    out: str = "runs/warm_start"
    """the folder to write the warmed-up model to (a plain HF folder: --model OUT); must not exist, or hold an
    earlier warm start and nothing else"""
    model: str = common.BUNDLED_MODEL
    """the model to warm up"""
    num_steps: int = 30
    """optimizer steps"""
    batch_size: int = 16
    """examples per step"""
    learning_rate: float = 5e-5
    """AdamW learning rate"""
    seed: int = 1
    """seed of the examples and their order"""
    operators: str = "+-*/"
    """operators of the examples' expressions, each drawn uniformly (never chosen by the target)"""
    trace: Literal["guess", "search"] = "guess"
    """`guess`: the completion restates the target and names one expression; `search`: it first tries 1 to
    --max-tries random expressions and works out each one's value (`Try 83 + 21 = 104.`), then answers with
    the last one tried, so the model learns to write values out, and when to stop is left to RL (it needs more
    new tokens than the default 48: the pilot used 80)"""
    max_tries: int = 3
    """with --trace search: most expressions tried before the answer (how many is drawn uniformly)"""
    prompt_template: Literal["auto", "chat", "base"] = "auto"
    """the prompt the RL runs will use (training's --prompt-template)"""
    test_size: int = 128
    """with the --task-* flags: the held-out split that no example may come from (training's --test-size)"""
    task_min_numbers: int = 2
    """held-out split to avoid: fewest numbers per task"""
    task_max_numbers: int = 2
    """held-out split to avoid: most numbers per task"""
    task_max_value: int = 20
    """held-out split to avoid: numbers are drawn from 1..task_max_value"""
    task_operators: str = "+*"
    """held-out split to avoid: operators of its hidden solutions"""
    labels_only: bool = False
    """print the operator table of the examples these settings train on (label_table) as JSON and exit: no model
    is loaded and --out is not touched"""


def random_expression(nums: list[int], operators: str, rng: random.Random,
                      largest_first: bool = False) -> tuple[str, Fraction]:
    """Every number once, left to right with uniformly drawn operators: (text, value). The numbers in random
    order, or largest first (the warm start's convention: a difference written that way is never negative)."""
    order = sorted(nums, reverse=True) if largest_first else rng.sample(nums, len(nums))
    expr, value = str(order[0]), Fraction(order[0])
    for i, n in enumerate(order[1:], start=1):
        op = rng.choice(operators)
        value = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op]  # numbers are >= 1
        expr = f"{expr} {op} {n}" if i == len(order) - 1 else f"({expr} {op} {n})"
    return expr, value


def examples(args: Args, count: int, exclude: set) -> list[dict]:
    """`count` examples: a task (numbers from 21..99, its target the value of another random expression
    over them) and a completion whose expression is drawn independently of that target."""
    rng, out = random.Random(args.seed), []
    while len(out) < count:
        nums = [rng.randint(MIN_VALUE, 99) for _ in range(rng.randint(2, 4))]
        _, target = random_expression(nums, "+-*/", rng)
        if target.denominator != 1 or not 0 < target <= 999:
            continue
        task = {"nums": nums, "target": int(target)}
        if common.task_key(task) in exclude:
            continue
        if args.trace == "search":  # how many tries and which ones are drawn without looking at the target
            tries = [random_expression(nums, args.operators, rng, largest_first=True)
                     for _ in range(rng.randint(1, args.max_tries))]
            expr = tries[-1][0]
            work = "".join(f" Try {e} = {v}." for e, v in tries)  # a Fraction prints as 83/21
        else:
            expr, work = random_expression(nums, args.operators, rng, largest_first=True)[0], ""
        text = f"</think>\n<answer> {expr} </answer>"
        assert countdown_reward.is_well_formed(text) and countdown_reward.uses_numbers_exactly(expr, nums)
        out.append({**task, "completion": f" The target is {task['target']}.{work} I will try {expr}.{text}"})
    return out


def training_examples(args: Args) -> list[dict]:
    """The examples a warm start with these settings trains on, in order: none from the held-out split the
    --task-* flags and --test-size name."""
    _, held_out = common.load_countdown("generated", args.test_size, args.seed, train_size=1,
                                        min_numbers=args.task_min_numbers, max_numbers=args.task_max_numbers,
                                        max_value=args.task_max_value, operators=args.task_operators)
    return examples(args, args.num_steps * args.batch_size, {common.task_key(t) for t in held_out})


TWO_NUMBER_TEMPLATES = common.expression_templates(2)


def label_table(data: list[dict]) -> dict:
    """The two-number examples' answers by the operator that is right: {right: {answered: count}}. Labels drawn
    without looking at the target answer `+` as often where `+` is right as where it is not."""
    table: dict[str, dict[str, int]] = {}
    for e in data:
        if len(e["nums"]) != 2:
            continue
        hits = {common.expression_operators(common.template_text(template)) for template in TWO_NUMBER_TEMPLATES
                if common.template_value(template, e["nums"]) == e["target"]}  # either order of the numbers
        right = "".join(sorted(hits)) or "none"
        answered = common.expression_operators(countdown_reward.extract_answer(e["completion"]))
        table.setdefault(right, {})
        table[right][answered] = table[right].get(answered, 0) + 1
    return {right: dict(sorted(row.items())) for right, row in sorted(table.items())}


def check_args(args: Args) -> None:
    bookkeeping.check_finite(args)
    bookkeeping.check_task_args(args)
    for name in ("num_steps", "batch_size", "test_size", "max_tries"):
        common.require(getattr(args, name) >= 1, name, getattr(args, name), "a positive integer")
    common.require(args.learning_rate > 0, "learning_rate", args.learning_rate, "> 0")
    common.require(bool(args.operators) and set(args.operators) <= set("+-*/"), "operators", args.operators,
                   "one or more of + - * /")


MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
               "model-?????-of-?????.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
               "chat_template.json", MARKER)
"""what save_pretrained writes (weights, config, tokenizer), and MARKER: what an earlier warm start may hold
besides the files its MARKER lists (a tokenizer may write others, such as spiece.model)"""


def written_files(out: Path) -> set[str]:
    """The names MARKER lists as written with it (none for a warm start from before the list, or a MARKER that
    is not a JSON object a run could have written: read_json_object follows no link and waits on no FIFO)."""
    files = bookkeeping.read_json_object(out / MARKER).get("files")
    return {name for name in files if isinstance(name, str)} if isinstance(files, list) else set()


def lock_path(out: Path) -> Path:
    """The lock beside --out that two warm starts writing the same folder take in turn."""
    return out.parent / f".{out.name}.lock"


def check_out(out: Path) -> None:
    """--out may be missing, or an earlier warm start (it holds MARKER and model files only): replacing it
    removes the folder, so anything else in it (an evaluation beside it, notes) is refused."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise common.ConfigError(f"--out={str(out)!r} is not allowed: it is a file or a link, not a folder")
    common.file_lock(lock_path(out), f"--out={str(out)!r}")  # refused now if a link, not after training
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise common.ConfigError(f"--out={str(out)!r} is not allowed: the folder exists and was not written by "
                                 f"study/warm_start.py (no {MARKER}); name a new folder")
    if out.is_dir():
        written = written_files(out)
        others = sorted(p.name for p in out.iterdir() if p.is_symlink() or not p.is_file()
                        or not (p.name in written or any(fnmatch.fnmatch(p.name, pattern) for pattern in MODEL_FILES)))
        if others:
            raise common.ConfigError(f"--out={str(out)!r} is not allowed: besides an earlier warm start it holds "
                                     f"{', '.join(others[:3])}, which replacing it would delete; name a new folder")


def main(args: Args) -> str:
    check_args(args)
    if args.labels_only:
        data = training_examples(args)
        print(json.dumps({"examples": len(data), "two_number_examples_by_right_operator": label_table(data)}))
        return ""
    version = bookkeeping.code_version()  # the code that makes the examples and trains, not one edited meanwhile
    out = Path(args.out)
    check_out(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise common.ConfigError(f"--out={args.out!r} is not allowed: cannot create its parent "
                                 f"({err.strerror})") from None
    data = training_examples(args)
    common.seed_everything(args.seed)
    path = common.resolve_model(args.model)
    tokenizer = common.load_tokenizer(path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = common.load_model(path, device, dtype=common.compute_dtype("auto", device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
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
    seconds = round(time.perf_counter() - start)
    settings = {k: v for k, v in asdict(args).items() if k != "labels_only"}  # a build's record: resume compares it
    publish(model, tokenizer, out, {**settings, "examples": len(data), "seconds": seconds, "code_version": version})
    print(f"warm-started model: {args.out}  (use --model {args.out})")
    return args.out


def weights_sha256(folder: Path) -> dict[str, str]:
    """Each weights file's SHA-256: a run's args.json copies it (`model_source`), so two builds of the warm start
    can be told apart, or shown identical, by their bytes."""
    digests = {}
    for path in sorted(folder.glob("*.safetensors")):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
        digests[path.name] = digest.hexdigest()
    return digests


def publish(model, tokenizer, out: Path, record: dict) -> None:
    """Write the model into a fresh folder beside `out`, then rename it into place under a lock: a reader
    never sees half a folder, two warm starts never share a temporary folder, and only an earlier warm
    start (checked again under the lock) is replaced."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the model from other users of a shared cache
    try:
        model.save_pretrained(tmp)
        common.write_portable_config(tmp)
        tokenizer.save_pretrained(tmp)
        files = sorted([*(p.name for p in tmp.iterdir()), MARKER])  # what a later warm start may replace
        (tmp / MARKER).write_text(json.dumps({**record, "weights_sha256": weights_sha256(tmp), "files": files},
                                             indent=1))
        with common.file_lock(lock_path(out), f"--out={str(out)!r}"):  # checked again: training took minutes
            check_out(out)
            old = None
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
                os.replace(out, old / "model")
            try:
                os.replace(tmp, out)
            except OSError:
                if old is not None:  # the earlier warm start goes back where it was
                    os.replace(old / "model", out)
                    old.rmdir()
                raise
            if old is not None:
                shutil.rmtree(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    common.run_command(lambda: main(tyro.cli(Args)))
