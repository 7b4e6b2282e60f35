"""Shared fixtures and helpers: the bundled tokenizer, tiny randomly initialised models built from a config,
a script's Args and command line for a tiny run, toy rewards, running a script as a user does, reading its
metrics and checkpoint weights, and running one update under torchrun."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = str(max(1, (os.cpu_count() or 2) // WORKERS))
"""torch threads per test process: with `pytest -n 2` on 2 cores, one each (two processes spinning two threads
each on two cores ran the compute-heavy tests 2-4 times slower)"""
if WORKERS > 1:
    import torch

    torch.set_num_threads(int(THREADS))


def make_tiny_model_dir(path: Path, seed: int = 0, hidden_size: int = 64, layers: int = 2) -> str:
    """A 2-layer Llama with SmolLM2's tokenizer (vocab 49152), saved as a plain HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import common

    tokenizer = common.load_tokenizer(common.bundled_model_dir())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def bundled_dir() -> str:
    import common

    return common.bundled_model_dir()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, bundled_dir) -> str:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tokenizer(bundled_dir):
    import common

    return common.load_tokenizer(bundled_dir)


@pytest.fixture(scope="session")
def peaked_model_dir(tmp_path_factory, tiny_model_dir) -> str:
    """The tiny model with its final norm scaled up, so that, like a trained LM, it prefers some
    tokens in each context: sampled tokens recur and a toy reward can be learned in a few steps."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("peaked")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(9.0)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return str(path)


# ---- Args and command lines: one tiny configuration ---------------------------------------------------
TINY = dict(num_steps=1, prompts_per_step=2, group_size=2, max_new_tokens=4, learning_rate=1e-3, num_minibatches=1,
            eval_every=0, save_every=0, eval_size=1, test_size=8)
"""A run of seconds on a CPU: 2 prompts x 2 completions of at most 4 tokens per step, one minibatch, one
evaluation task; evaluated and saved only at the end (the defaults do the same in runs under 10 steps)."""


def script_args(module, **fields):
    """`module.Args` (grpo, dapo, ppo, plot, study/...) from flat field names, each put into the section of
    Args that holds it: the one place the tests construct an Args."""
    import bookkeeping

    return bookkeeping.build_args(module.Args, **fields)


def tiny_args(module, **overrides):
    """A training script's Args for a tiny run: TINY, then `overrides` (model, runs_dir, what a test is about)."""
    return script_args(module, **{**TINY, **overrides})


def as_flags(**fields) -> list[str]:
    """The command line that sets `fields`: `--name value`, and `--name` or `--no-name` for a bool."""
    flags = []
    for name, value in fields.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def tiny_flags(**overrides) -> list[str]:
    """tiny_args as a command line."""
    return as_flags(**{**TINY, **overrides})


# ---- Toy rewards -------------------------------------------------------------------------------------
def even_token_reward(rollout, tasks):
    """Toy reward: the fraction of a completion's tokens whose id is even; correct when all of them are."""
    ids, mask = rollout.completion_ids, rollout.completion_mask
    rewards = (((ids % 2 == 0) & (mask == 1)).sum(-1) / mask.sum(-1)).tolist()
    return rewards, [float(r == 1.0) for r in rewards], [1.0] * len(rewards)


def constant_reward(rollout, tasks):
    """Every completion well-formed and wrong: 0.1 each (the format score), so every group's rewards are
    equal and its advantage is exactly zero (eq. 10)."""
    n = len(rollout.texts)
    return [0.1] * n, [0.0] * n, [1.0] * n


def synthetic_rollout(batch_size: int = 8, prompt_len: int = 6, completion_len: int = 7, seed: int = 0):
    """A fixed rollout with left-padded prompts and completions of different lengths (no generation)."""
    import torch

    import common

    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(10, 40000, (batch_size, prompt_len), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    for i in range(batch_size):
        prompt_mask[i, : i % 3] = 0  # left padding
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 2)
    completion_ids = torch.randint(10, 40000, (batch_size, completion_len), generator=g)
    lengths = [1 + (3 * i) % completion_len for i in range(batch_size)]
    completion_mask = torch.tensor([[1] * n + [0] * (completion_len - n) for n in lengths])
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 2)
    return common.Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, [""] * batch_size,
                          ["stop"] * batch_size)


# ---- Running the scripts as a user does -------------------------------------------------------------
def subprocess_env(threads: str = THREADS) -> dict:
    """This environment without torchrun's variables (a test may run under one), with a thread count."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = threads
    return env


def run_script(args, timeout=600, torchrun=False, threads=THREADS):
    """`python SCRIPT ARGS...` (or under `torchrun --nproc_per_node=2`) from the repository root."""
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc_per_node=2"] if torchrun else [sys.executable]
    return subprocess.run(prefix + args, cwd=ROOT, env=subprocess_env(threads), capture_output=True, text=True,
                          timeout=timeout)


def read_metrics(path):
    """(run folder, its metrics.jsonl rows): `path` is a run folder, or a folder that holds one run folder."""
    run_dir = str(path)
    if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        (run_dir,) = [os.path.join(path, d) for d in os.listdir(path) if os.path.isdir(os.path.join(path, d))]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return run_dir, [json.loads(line) for line in f]


def checkpoint_weights(folder) -> dict:
    """{name: tensor} of the weights in a model folder or checkpoint (model.safetensors, or its shards)."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("model*.safetensors"))
    assert files, f"no model*.safetensors in {folder}"
    return {name: tensor for f in files for name, tensor in load_file(str(f)).items()}


# ---- The losses and the update, driven by hand ------------------------------------------------------
def one_token_loss(ratio: float, advantage: float, *clip, policy_loss=None):
    """A one-token completion whose ratio pi/pi_old is `ratio`: the loss, its gradient wrt log pi, the stats.
    `clip` and `policy_loss` default to GRPO's (eq. 9, epsilon 0.2); DAPO's tests pass eq. 12's."""
    import torch

    import grpo

    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, stats = (policy_loss or grpo.policy_loss)(logprobs, torch.zeros(1, 1), torch.tensor([advantage]),
                                                     torch.ones(1, 1), *(clip or (0.2,)))
    loss.backward()
    return loss.item(), logprobs.grad.item(), stats


def run_updates(algo, model_dir, out, configs, nproc=1):
    """tests/update_worker.py: one update of `algo` on a fixed batch for each of `configs` ({name: flags}), in
    1 or `nproc` processes, all in one launch (start-up takes most of the time); {name: the weights}."""
    import torch

    worker = os.path.join(ROOT, "tests", "update_worker.py")
    prefix = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                   f"--nproc_per_node={nproc}", "--standalone"]
    result = subprocess.run(prefix + [worker, algo, model_dir, str(out), json.dumps(configs)], capture_output=True,
                            text=True, env=subprocess_env("1"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out)


def assert_same_update_for_any_split(algo, model_dir, tmp_path, split_micro_batch_size, extra_one_process=None,
                                     **flags):
    """One process on the whole batch of 8, then 2 DDP and 2 FSDP2 processes with micro-batches of
    `split_micro_batch_size`: the same weights after the update (FSDP2 reduce-scatters instead). Then 4
    minibatches and 2 epochs (8 optimizer steps, each of 2 DDP processes holding 4 of the 8 rows): the minibatches
    are slices of one permutation of all rows, so 2 processes take the same 8 steps as 1. `extra_one_process`:
    more one-process configurations ({name: flags}, `flags` added) for the caller to compare; returns every
    one-process result by name, "whole" the batch of 8 in one micro-batch."""
    import torch

    steps = dict(num_minibatches=4, update_epochs=2, learning_rate=0.1)  # at 1.0, 8 steps amplify rounding to 1e-3
    if algo == "ppo":
        steps["critic_learning_rate"] = 0.01
    one_process = {"steps-one": dict(micro_batch_size=8, **steps), "whole": dict(micro_batch_size=8),
                   **(extra_one_process or {})}
    two_processes = {"steps-two": dict(micro_batch_size=1, **steps)}
    for fsdp in (False, True):
        two_processes[f"split-fsdp{fsdp}"] = dict(micro_batch_size=split_micro_batch_size, fsdp=fsdp)
        # micro-batches by a budget of 15 padded tokens: rank 0 needs 4, rank 1 only 3 (and balances its rows over 4)
        two_processes[f"packed-fsdp{fsdp}"] = dict(micro_batch_size=8, max_tokens_per_micro_batch=15, fsdp=fsdp)
    # one launch per process count: each configuration still starts from a fresh model (see update_worker.py)
    clash = set(flags) & {key for c in [*one_process.values(), *two_processes.values()] for key in c}
    assert not clash, f"{clash}: set by the comparison itself (the runs would no longer differ in them)"
    one = run_updates(algo, model_dir, tmp_path / "one.pt", {k: {**c, **flags} for k, c in one_process.items()})
    two = run_updates(algo, model_dir, tmp_path / "two.pt", {k: {**c, **flags} for k, c in two_processes.items()},
                      nproc=2)
    torch.testing.assert_close(two["steps-two"], one["steps-one"], atol=2e-6, rtol=1e-4,
                               msg=lambda m: f"4 minibatches: {m}")

    whole = one["whole"]
    for fsdp in (False, True):
        torch.testing.assert_close(two[f"split-fsdp{fsdp}"], whole, atol=2e-6, rtol=1e-4,
                                   msg=lambda m: f"fsdp={fsdp}: {m}")
        torch.testing.assert_close(two[f"packed-fsdp{fsdp}"], whole, atol=2e-6, rtol=1e-4,
                                   msg=lambda m: f"packed, fsdp={fsdp}: {m}")
    return one
