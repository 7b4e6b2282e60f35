"""The GPU precision recipe, run on the CPU (bf16 autocast works there): float32 master weights keep the
paper's 1e-6 updates that bfloat16 weights round away, and the forward really runs in bfloat16."""

import os

import pytest
import torch
from safetensors.torch import load_file

import common
import grpo
from conftest import even_token_reward

STEPS = 3


def changed_fraction(before: dict, after: dict) -> float:
    changed = sum((before[k] != after[k]).sum().item() for k in before)
    return changed / sum(t.numel() for t in before.values())


def test_bf16_compute_with_fp32_weights_keeps_every_update_at_lr_1e6(tiny_model_dir, tmp_path):
    args = grpo.Args(model=tiny_model_dir, compute_dtype="bfloat16", learning_rate=1e-6, num_steps=STEPS,
                     prompts_per_step=2, group_size=4, max_new_tokens=8, beta=0.01, eval_every=0, save_every=0,
                     eval_size=1, test_size=8, runs_dir=str(tmp_path), seed=3)
    out = grpo.train(args, reward_fn=even_token_reward)
    after = load_file(os.path.join(out["run_dir"], f"checkpoint-{STEPS}", "model.safetensors"))
    before = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in after.values())  # the master copy is what is saved
    assert changed_fraction(before, after) >= 0.99


def test_bf16_weights_lose_most_of_the_same_update(tiny_model_dir):
    """The recipe the test above replaces (AdamW on bfloat16 weights): at lr 1e-6 most updates round
    away, so the >= 99% bound above separates the two recipes."""
    torch.manual_seed(0)
    model = common.load_model(tiny_model_dir, torch.device("cpu")).to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    ids = torch.randint(0, 1000, (4, 12))
    for _ in range(STEPS):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert changed_fraction(before, model.state_dict()) < 0.5


def test_the_forward_runs_in_the_compute_dtype_and_the_weights_stay_float32(tiny_model_dir):
    model = common.load_model(tiny_model_dir, torch.device("cpu"), dtype=torch.bfloat16)
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    ids = torch.randint(0, 1000, (2, 6))
    logprobs, _ = common.completion_logprobs(model, ids, torch.ones_like(ids), ids, torch.ones_like(ids))
    hook.remove()
    assert seen == [torch.bfloat16] and logprobs.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    plain = common.load_model(tiny_model_dir, torch.device("cpu"))
    reference, _ = common.completion_logprobs(plain, ids, torch.ones_like(ids), ids, torch.ones_like(ids))
    assert 0 < (logprobs - reference).abs().max() < 0.1  # bf16 products: close to, not equal to, fp32


@pytest.mark.parametrize("name,device,expected", [("auto", "cpu", torch.float32), ("auto", "cuda", torch.bfloat16),
                                                  ("bfloat16", "cpu", torch.bfloat16), ("float32", "cuda", torch.float32)])
def test_compute_dtype_flag(name, device, expected):
    assert common.compute_dtype(name, torch.device(device)) == expected


def equal_rewards(rollout, tasks):
    """Every completion scores 0.1: every group's advantage is exactly zero (eq. 10)."""
    n = len(rollout.texts)
    return [0.1] * n, [0.0] * n, [1.0] * n


@pytest.mark.parametrize("script", ["grpo", "dapo"])
def test_no_signal_no_update_even_with_a_kl_term(script, tiny_model_dir, tmp_path):
    """Zero advantages and pi_theta = pi_ref: the true gradient is exactly zero, and AdamW turns any float
    round-off left in it into a full learning-rate step. The reference log-probs must therefore equal the
    policy's bit for bit, although micro-batches are sorted and cut to different widths (G = 8, 4
    minibatches, micro-batches of 3)."""
    import importlib

    algo = importlib.import_module(script)
    args = algo.Args(model=tiny_model_dir, num_steps=1, prompts_per_step=2, group_size=8, max_new_tokens=12,
                     learning_rate=1e-3, beta=0.05, num_minibatches=4, micro_batch_size=3, eval_size=0,
                     test_size=8, runs_dir=str(tmp_path), save_every=1, **({"dynamic_sampling": False} if script == "dapo" else {}))
    out = algo.train(args, reward_fn=equal_rewards)
    assert out["charts/advantage_std"] == 0.0 and out["losses/kl_ref"] == 0.0
    after = load_file(os.path.join(out["run_dir"], "checkpoint-1", "model.safetensors"))
    before = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert all(torch.equal(after[k], before[k]) for k in before)
