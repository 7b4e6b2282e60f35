"""Shared fixtures: the bundled tokenizer and tiny randomly initialised models built from a config."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


def even_token_reward(rollout, tasks):
    """Toy reward: the fraction of a completion's tokens whose id is even; correct when all of them are."""
    ids, mask = rollout.completion_ids, rollout.completion_mask
    rewards = (((ids % 2 == 0) & (mask == 1)).sum(-1) / mask.sum(-1)).tolist()
    return rewards, [float(r == 1.0) for r in rewards], [1.0] * len(rewards)


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
