"""The GPU precision recipe, run on the CPU (bf16 autocast works there): float32 master weights keep the
paper's 1e-6 updates that bfloat16 weights round away, and the forward really runs in bfloat16."""

import typing

import pytest
import torch

import common
import grpo
from conftest import checkpoint_weights, constant_reward, even_token_reward, tiny_args

STEPS = 3


def changed_fraction(before: dict, after: dict) -> float:
    changed = sum((before[k] != after[k]).sum().item() for k in before)
    return changed / sum(t.numel() for t in before.values())


def test_bf16_compute_with_fp32_weights_keeps_every_update_at_lr_1e6(tiny_model_dir, tmp_path):
    args = tiny_args(grpo, model=tiny_model_dir, compute_dtype="bfloat16", learning_rate=1e-6, num_steps=STEPS,
                     group_size=4, max_new_tokens=8, num_minibatches=2, beta=0.01, runs_dir=str(tmp_path), seed=3)
    out = grpo.train(args, reward_fn=even_token_reward)
    after = checkpoint_weights(f"{out['run_dir']}/checkpoint-{STEPS}")
    before = checkpoint_weights(tiny_model_dir)
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


COMPUTE_DTYPES = typing.get_args(typing.get_type_hints(common.SystemArgs)["compute_dtype"])  # the flag's choices


@pytest.mark.parametrize("name", COMPUTE_DTYPES)
def test_compute_dtype_flag(name, tiny_model_dir):
    """Each value --compute-dtype accepts, through the scripts' path (compute_dtype, then load_model): on a CPU
    the forward's matrix products run in it (`auto`: float32, no bf16 matrix units there) and the log-probs are
    float32; on a GPU `auto` is bfloat16 and a named dtype stays what it names."""
    cpu = common.compute_dtype(name, torch.device("cpu"))
    model = common.load_model(tiny_model_dir, torch.device("cpu"), dtype=cpu)
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    ids = torch.randint(0, 1000, (2, 6))
    logprobs, _ = common.completion_logprobs(model, ids, torch.ones_like(ids), ids, torch.ones_like(ids))
    hook.remove()
    assert seen == [torch.bfloat16 if name == "bfloat16" else torch.float32] and logprobs.dtype == torch.float32
    assert common.compute_dtype(name, torch.device("cuda")) == (torch.bfloat16 if name == "auto" else cpu)


@pytest.mark.parametrize("script", ["grpo", "dapo"])
def test_no_signal_no_update_even_with_a_kl_term(script, tiny_model_dir, tmp_path):
    """Zero advantages and pi_theta = pi_ref: the true gradient is exactly zero, and AdamW turns any float
    round-off left in it into a full learning-rate step. The reference log-probs must therefore equal the
    policy's bit for bit, although micro-batches are sorted and cut to different widths (G = 8, 4
    minibatches, micro-batches of 3)."""
    import importlib

    algo = importlib.import_module(script)
    args = tiny_args(algo, model=tiny_model_dir, group_size=8, max_new_tokens=12, beta=0.05, num_minibatches=4,
                     micro_batch_size=3, eval_size=0, runs_dir=str(tmp_path), save_every=1,
                     **({"dynamic_sampling": False} if script == "dapo" else {}))
    out = algo.train(args, reward_fn=constant_reward)
    assert out["charts/advantage_std"] == 0.0 and out["losses/kl_ref"] == 0.0
    after = checkpoint_weights(f"{out['run_dir']}/checkpoint-1")
    before = checkpoint_weights(tiny_model_dir)
    assert all(torch.equal(after[k], before[k]) for k in before)
