"""Model FLOPs of the update phase and this machine's matrix-product rate, for the MFU figures of
gpu_check.py and bench_grpo.py."""

from __future__ import annotations

import time

import torch


def matmul_tflops(device: str, dtype=torch.bfloat16, n: int = 8192, repeats: int = 20) -> float:
    """This device's dense matrix-product rate: the ceiling the update's FLOP/s is compared with."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def update_flops(model_dir: str, sequences: int, prompt_tokens: float, completion_tokens: float, passes: dict,
                 output_layer: bool = True) -> float:
    """Model FLOPs of one step's update phase, as MFU counts them: 6 x non-embedding parameters per token
    for a forward + backward, 2 x for a forward-only pass (old and reference log-probs), plus the output
    layer on completion positions; attention's quadratic term and activation recomputation not counted."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    h, layers, inter = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    kv = config.num_key_value_heads * h // config.num_attention_heads
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * inter  # q, k, v, o projections and the gated MLP
    body, head = layers * per_layer, h * config.vocab_size * output_layer
    tokens = sequences * (prompt_tokens + completion_tokens)
    completion = sequences * completion_tokens
    per_pass = {"train": 6, "forward": 2}
    return sum(count * per_pass[kind] * (body * tokens + head * completion) for kind, count in passes.items())
