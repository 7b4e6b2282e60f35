"""The paper's configuration on a GPU, checked end to end without a download.

Builds a randomly initialised model of Qwen2.5-1.5B-Instruct's shape (28 layers, hidden 1536, vocabulary
151,936, tied embeddings) with a generation_config.json that tries to change sampling as Qwen's does, then
runs ppo.py, grpo.py and dapo.py for a few steps each at the paper's learning rate (1e-6) and completion
length (1024 new tokens), with fewer prompts per step than the paper's 256 so that the check takes
minutes, and a dense toy reward (a random model never solves Countdown). For each script it checks that the
weights changed (fp32 master weights keep a 1e-6 step), that
every logged loss is finite, and prints peak GPU memory and seconds per step; then it measures the gap
between HF sampling and the log-prob pass, both in bf16. One JSON line per check; exit 1 if one failed.

    python benchmark/gpu_check.py --tokenizer TOKENIZER_DIR [--scripts ppo grpo dapo] [--steps 2]

TOKENIZER_DIR: any HF tokenizer folder (the bundled SmolLM2's works: the model's vocabulary is larger).
`--device cpu --layers 1 --max-new-tokens 8` runs the same checks in a minute on a CPU (bf16 autocast
works there), to try the script itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

import common  # noqa: E402
from flops import matmul_tflops, update_flops  # noqa: E402

QWEN25_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                   num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                   rms_norm_eps=1e-6, tie_word_embeddings=True)
# per script: its own flags at the paper's values (README "The paper's setup"), fewer prompts per step; grpo/dapo
# take --num-minibatches (default: the scripts' 2; the paper's line in study/run.py uses 4)
FLAGS = {
    "ppo": dict(prompts_per_step=64, group_size=1, beta=0.001, critic_learning_rate=1e-5, num_minibatches=2),
    "grpo": dict(prompts_per_step=8, group_size=8, beta=0.01),
    "dapo": dict(prompts_per_step=8, group_size=8, dynamic_sampling=False),  # + overlong buffer: max_new_tokens / 4
}


def build_model(path: str, tokenizer_dir: str, layers: int, device: str) -> None:
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(**{**QWEN25_1_5B, "num_hidden_layers": layers}, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)  # stored in bf16, as the hub's checkpoint is
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    GenerationConfig(do_sample=True, repetition_penalty=1.1, temperature=0.7, top_p=0.8, top_k=20,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(path)


def even_token_reward(rollout, tasks):
    """A dense toy reward (the fraction of even token ids): a random model never scores on Countdown, and
    equal rewards would give GRPO and DAPO no gradient to check."""
    ids, mask = rollout.completion_ids, rollout.completion_mask
    rewards = (((ids % 2 == 0) & (mask == 1)).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()
    return rewards, [float(r == 1.0) for r in rewards], [1.0] * len(rewards)


def load_weights(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                out.update({k: f.get_tensor(k).float() for k in f.keys()})
    return out


def changed_fraction(before: dict, after: dict) -> float:
    changed = sum((before[k] != after[k]).sum().item() for k in before if k in after)
    return changed / sum(t.numel() for k, t in before.items() if k in after)


def check_script(name: str, model_dir: str, runs_dir: str, steps: int, max_new_tokens: int, device: str,
                 micro_batch_size: int, max_tokens: int, peak_tflops: float, num_minibatches: int = 2) -> dict:
    import importlib
    import shutil

    import bookkeeping

    algo = importlib.import_module(name)
    args = bookkeeping.build_args(
        algo.Args, model=model_dir, runs_dir=runs_dir, num_steps=steps, learning_rate=1e-6,
        max_new_tokens=max_new_tokens, micro_batch_size=micro_batch_size, eval_every=0, eval_size=0, save_every=0,
        device=device, compute_dtype="bfloat16", max_tokens_per_micro_batch=max_tokens,
        **{"num_minibatches": num_minibatches, **FLAGS[name]})  # ppo.py's own entry keeps its 2
    if name == "dapo":
        args.overlong_buffer = max_new_tokens // 4
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = algo.train(args, reward_fn=even_token_reward)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in open(os.path.join(out["run_dir"], "metrics.jsonl"))]
    rows = [r for r in rows if r["step"] >= 1]
    losses = {k: v for r in rows for k, v in r.items() if k.startswith("losses/")}
    after = load_weights(os.path.join(out["run_dir"], f"checkpoint-{steps}"))
    before = load_weights(model_dir)
    result = {
        "check": name, "steps": steps, "sequences_per_step": args.prompts_per_step * args.group_size,
        "max_new_tokens": max_new_tokens, "micro_batch_size": micro_batch_size, "compute_dtype": "bfloat16",
        "saved_dtype": str(next(iter(after.values())).dtype),
        "changed_fraction": changed_fraction(before, after),
        "losses_finite": all(math.isfinite(v) for v in losses.values()),
        "clipfrac": [r.get("losses/clipfrac") for r in rows],
        "response_length": [r["charts/response_length"] for r in rows],
        "seconds_per_step": [round(r["time/step"], 1) for r in rows],
        "generation_seconds": [round(r["time/generation"], 1) for r in rows],
        "update_seconds": [round(r["time/update"], 1) for r in rows],
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if device == "cuda" else None,
        "wall_seconds": round(wall, 1),
    }
    # the update phase: old log-probs (unless on-policy), reference log-probs (beta > 0), the update itself
    tokenizer = common.load_tokenizer(model_dir)
    prompt_tokens = sum(len(tokenizer(common.make_prompt(tokenizer, t), add_special_tokens=False).input_ids)
                        for t in common.generate_tasks(32, 0)) / 32
    sequences = args.prompts_per_step * args.group_size
    passes = {"train": args.update_epochs, "forward": int(args.beta > 0)
              + int(name == "ppo" or not (args.update_epochs == 1 and args.num_minibatches == 1))}
    last = rows[-1]
    flops = update_flops(model_dir, sequences, prompt_tokens, last["charts/response_length"], passes)
    if name == "ppo":  # the critic: the same body with a 1-output head; old values, then trained per epoch
        flops += update_flops(model_dir, sequences, prompt_tokens, last["charts/response_length"],
                              {"forward": 1, "train": args.update_epochs}, output_layer=False)
    result.update(prompt_tokens=round(prompt_tokens, 1), max_tokens_per_micro_batch=max_tokens,
                  update_tflop=round(flops / 1e12, 1), update_tflops=round(flops / last["time/update"] / 1e12, 2),
                  update_mfu=round(flops / last["time/update"] / 1e12 / peak_tflops, 3))
    result["ok"] = result["changed_fraction"] >= 0.99 and result["losses_finite"]
    shutil.rmtree(out["run_dir"], ignore_errors=True)  # a 1.5B checkpoint with AdamW state is ~18 GB
    return result


def check_sampler_gap(model_dir: str, device: str) -> dict:
    """HF sampling and the log-prob pass both run the bf16 recipe: how far apart are their log-probs?"""
    model = common.load_model(model_dir, torch.device(device), dtype=torch.bfloat16)
    tokenizer = common.load_tokenizer(model_dir)
    backend = common.HFBackend(model, tokenizer, torch.bfloat16)
    prompts = [common.make_prompt(tokenizer, t) for t in common.generate_tasks(4, 0)]
    rollout = backend.generate(prompts, 4, 256, 1.0, seed=0, return_logprobs=True)
    logprobs, _ = common.batched_logprobs(model, rollout, 16)
    mask = rollout.completion_mask.bool()
    gap = (rollout.logprobs[mask] - logprobs[mask]).abs()
    return {"check": "sampler_gap", "tokens": int(mask.sum()), "mean_abs_logprob_gap": gap.mean().item(),
            "max_abs_logprob_gap": gap.max().item(), "ok": bool(torch.isfinite(gap).all())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="an HF tokenizer folder")
    parser.add_argument("--scripts", nargs="+", default=["grpo", "dapo", "ppo"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--out", default="", help="also append the JSON lines to this file")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--layers", type=int, default=QWEN25_1_5B["num_hidden_layers"])
    parser.add_argument("--micro-batch-size", type=int, default=8, help="ppo.py gets half (it also trains a critic)")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=0, help="pack the update by tokens (0: off)")
    parser.add_argument("--num-minibatches", type=int, default=2,
                        help="grpo.py's and dapo.py's optimizer steps per step (the 2026-11-30 runs: 4); "
                             "ppo.py keeps 2")
    a = parser.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (--device cpu tries the script on a CPU)", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="gpu_check-")
    model_dir = os.path.join(work, "qwen2.5-1.5b-shaped")
    build_model(model_dir, a.tokenizer, a.layers, a.device)
    ok = True
    peak = matmul_tflops(a.device, torch.bfloat16 if a.device == "cuda" else torch.float32)
    print(json.dumps({"check": "matmul", "tflops": round(peak, 1)}), flush=True)
    checks = [lambda n=n: check_script(n, model_dir, os.path.join(work, "runs"), a.steps, a.max_new_tokens, a.device,
                                       a.micro_batch_size // (2 if n == "ppo" else 1),
                                       a.max_tokens_per_micro_batch // (2 if n == "ppo" else 1), peak,
                                       a.num_minibatches)
              for n in a.scripts] + [lambda: check_sampler_gap(model_dir, a.device)]
    for check in checks:
        result = check()
        result["device"] = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
        result["layers"] = a.layers
        ok &= result["ok"]
        line = json.dumps(result)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
