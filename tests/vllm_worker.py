"""Checks that need a real vLLM engine, run in their own process (the in-process engine pins torch's
threads). Prints one JSON line.

usage: python tests/vllm_worker.py MODEL_DIR OUT_DIR
"""

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import common  # noqa: E402
import grpo  # noqa: E402
from conftest import script_args  # noqa: E402


def greedy(backend, prompts):
    r = backend.generate(prompts, 1, 16, 0.0)
    return [ids[m.bool()].tolist() for ids, m in zip(r.completion_ids, r.completion_mask)], r


def main():
    model_dir, out_dir = sys.argv[1:3]
    world = common.Dist()
    tok = common.load_tokenizer(model_dir)
    policy = common.load_model(model_dir, world.device)
    args = script_args(grpo, backend="vllm", max_new_tokens=16)
    engine = common.make_backend("vllm", policy, tok, args.system, args.task, args.seed, model_dir, world)
    hf = common.make_backend("hf", policy, tok, args.system)
    prompts = [common.make_prompt(tok, t) for t in common.generate_tasks(4, 3)]
    result = {}

    # 1. greedy vLLM against HF generate on the same weights (both fp32 on CPU)
    v, rollout = greedy(engine, prompts)
    h, _ = greedy(hf, prompts)
    result["identical_greedy"] = sum(a == b for a, b in zip(v, h))
    result["common_prefix"] = [next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
                               for a, b in zip(v, h)]
    teacher = common.batched_logprobs(policy, rollout, 8)[0]
    m = rollout.completion_mask.bool()
    result["logprob_abs_diff"] = (teacher[m] - rollout.logprobs[m]).abs().mean().item()

    # 1b. sampled at temperature 0.7: the engine's log-probs are the policy's, whatever the checkpoint's
    # generation_config.json asks for (the test writes one with a repetition penalty and top-k)
    sampled = engine.generate(prompts, 4, 16, 0.7, seed=0)
    teacher = common.batched_logprobs(policy, sampled, 8, 0.7)[0]
    m = sampled.completion_mask.bool()
    result["sampled_logprob_abs_diff"] = (teacher[m] - sampled.logprobs[m]).abs().mean().item()

    # 2. change the trained weights (the tied embedding too) and push them into the running engine
    original = {k: p.detach().clone() for k, p in policy.named_parameters()}
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * p.std())
    engine.sync_weights(policy)
    synced, _ = greedy(engine, prompts)
    result["changed_output"] = synced != v
    changed = os.path.join(out_dir, "changed")
    policy.save_pretrained(changed)
    tok.save_pretrained(changed)

    # 3. restore the original weights: the engine gives its original output again
    with torch.no_grad():
        for k, p in policy.named_parameters():
            p.copy_(original[k])
    engine.sync_weights(policy)
    result["restored_equals_original"] = greedy(engine, prompts)[0] == v

    # 4. a fresh engine started from the changed weights gives what the synced engine gave (created
    # last: tearing down a second in-process engine would reset vLLM's global state under the first)
    fresh = common.make_backend("vllm", policy, tok, args.system, args.task, args.seed, changed, world)
    result["synced_equals_fresh"] = synced == greedy(fresh, prompts)[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
