"""Compute spent on padding in the update, and the update's time, for three ways of cutting a batch of
completions of very different lengths into micro-batches:

  rectangle  micro-batches of --micro-batch-size rows in shuffled order, each the whole padded rectangle
             (no column is trimmed: the padding of the whole batch is computed)
  sorted     rows sorted by length, --micro-batch-size rows each, each cut to its longest row (the default)
  packed     sorted and packed up to --max-tokens padded tokens per micro-batch (--max-tokens-per-micro-batch)

One forward + backward of the log-prob pass with a sample-level loss over the whole batch, on a small random
Llama with SmolLM2's vocabulary; the gradients of the three must agree. Prints one JSON line per setting.

    python benchmark/bench_padding.py            # 64 completions, lengths uniform in 20..512, 2 repeats
    python benchmark/bench_padding.py --max-tokens 16384 --repeats 0   # how a budget splits them, no timing
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import common  # noqa: E402


def batch(n: int, prompt: int, low: int, high: int, seed: int = 0) -> common.Rollout:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g)
    completion_mask = (torch.arange(high) < lengths[:, None]).long()
    prompt_ids = torch.randint(10, 40000, (n, prompt), generator=g)
    completion_ids = torch.randint(10, 40000, (n, high), generator=g).masked_fill(completion_mask == 0, 2)
    return common.Rollout(prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask, [""] * n,
                          ["stop"] * n)


def update(model, rollout: common.Rollout, micro_batches: list[common.MicroBatch]) -> tuple[float, torch.Tensor]:
    """Seconds of one forward + backward over the micro-batches, and the flattened gradient."""
    model.zero_grad(set_to_none=True)
    n = len(rollout.completion_ids)
    start = time.perf_counter()
    for mb in micro_batches:
        logprobs, _ = common.completion_logprobs(model, *mb.inputs(rollout))
        mask = mb(rollout.completion_mask).float()
        per_sequence = (logprobs * mask).sum(-1) / mask.sum(-1)  # sample-level, as GRPO's eq. 9
        (per_sequence.sum() / n).backward()
    seconds = time.perf_counter() - start
    return seconds, torch.cat([p.grad.flatten() for p in model.parameters()])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=150, help="prompt tokens")
    parser.add_argument("--min-length", type=int, default=20)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per setting (0: token counts only)")
    parser.add_argument("--out", default="", help="also append the JSON lines to this file")
    a = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                                         num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                                         num_key_value_heads=a.hidden // 128, tie_word_embeddings=True))
    model = common.autocast_forward(model, torch.float32)
    common.disable_dropout(model)
    rollout = batch(a.sequences, a.prompt, a.min_length, a.max_length)
    rows = torch.randperm(a.sequences, generator=torch.Generator().manual_seed(1))
    P, T = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    settings = {
        "rectangle": [common.MicroBatch(idx, P, T) for idx in rows.split(a.micro_batch_size)],
        "sorted": common.micro_batches(rollout, rows, a.micro_batch_size),
        "packed": common.micro_batches(rollout, rows, a.micro_batch_size, a.max_tokens),
    }
    useful = int(rollout.prompt_mask.sum() + rollout.completion_mask.sum())
    results = {name: {"setting": name, "micro_batches": len(mbs), "rows": [len(mb.idx) for mb in mbs],
                      "processed_tokens": sum(mb.padded_tokens for mb in mbs),
                      "largest_micro_batch_tokens": max(mb.padded_tokens for mb in mbs), "useful_tokens": useful}
               for name, mbs in settings.items()}
    reference = None
    for _ in range(a.repeats):  # interleaved, so a slow moment of the machine hits every setting
        for name, micro_batches in settings.items():
            seconds, grad = update(model, rollout, micro_batches)
            reference = grad if reference is None else reference
            results[name]["seconds"] = round(min(results[name].get("seconds", float("inf")), seconds), 2)
            results[name]["max_grad_diff"] = float((grad - reference).abs().max())
    for r in results.values():
        r["padding_waste"] = round(1 - r["useful_tokens"] / r["processed_tokens"], 3)
        if a.repeats:
            r["speedup_vs_rectangle"] = round(results["rectangle"]["seconds"] / r["seconds"], 2)
        line = json.dumps({**r, "sequences": a.sequences, "lengths": f"{a.min_length}..{a.max_length}",
                           "prompt_tokens": a.prompt, "hidden": a.hidden, "layers": a.layers,
                           "max_tokens": a.max_tokens, "threads": torch.get_num_threads()})
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
