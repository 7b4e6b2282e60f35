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
