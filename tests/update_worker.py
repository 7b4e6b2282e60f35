"""Run one algorithm's update on a fixed synthetic batch, one process or under torchrun, for each of several
configurations, and save the resulting weights. Each process takes its contiguous share of the batch, as the
training loop does. Each configuration starts from the same state, as if it ran alone: one launch runs them all
because start-up and imports take most of the time.

usage: [torchrun --nproc_per_node=N] update_worker.py ALGO MODEL_DIR OUT.pt CONFIGS
CONFIGS: JSON {name: {flag: value, ...}, ...}; OUT.pt: {name: the updated weights, flattened}
"""

import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bookkeeping  # noqa: E402

import common  # noqa: E402
from conftest import script_args, synthetic_rollout  # noqa: E402


def update(algo_name, model_dir, flags, world):
    """One configuration's update from a fresh model; the weights, flattened, on the main process (else None)."""
    algo = importlib.import_module(algo_name)
    defaults = bookkeeping.flat_args(script_args(algo))
    overrides = {k: float(v) if isinstance(defaults[k], float) and type(v) is int else v  # a learning rate of 1
                 for k, v in flags.items()}
    wrong = {k: v for k, v in overrides.items() if type(v) is not type(defaults[k])}
    assert not wrong, f"flags of another type than their defaults: {wrong}"  # "False" is not False
    # no gradient clipping: it would hide a wrongly scaled gradient. One minibatch of one epoch unless the
    # test asks for more (the minibatches are slices of one permutation of both processes' rows)
    ppo_settings = dict(critic_learning_rate=1.0, lam=0.95, clip_value=0.05) if algo_name == "ppo" else {}
    args = script_args(algo, **{**dict(model=model_dir, beta=0.05, learning_rate=1.0, group_size=4, prompts_per_step=2,
                                       max_grad_norm=1e9, num_minibatches=1), **ppo_settings, **overrides})
    torch.manual_seed(0)
    policy = common.load_model(model_dir, world.device)
    ref_model = common.load_model(model_dir, world.device, trainable=False)
    with torch.no_grad():  # a reference that differs from the policy, so the KL term has a gradient
        for p in ref_model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))

    full = synthetic_rollout(batch_size=8)
    rewards = torch.tensor([0.0, 1.0, 0.1, 0.1, 1.0, 1.0, 0.0, 0.1])
    advantages = algo.group_advantages(rewards, args.group_size) if hasattr(algo, "group_advantages") else None
    ref_logprobs_full = common.batched_logprobs(ref_model, full, 8)[0]
    old_logprobs_full = common.batched_logprobs(policy, full, 8)[0] + 0.05 * torch.randn(
        full.completion_ids.shape, generator=torch.Generator().manual_seed(1))

    share = len(rewards) // world.world_size
    s = slice(world.rank * share, (world.rank + 1) * share)
    mine = full.select(list(range(len(rewards)))[s])
    trained = [policy]
    if algo_name == "ppo":
        # per-token rewards (eq. 8), GAE, and whitening over both processes' shares together
        critic = algo.load_value_model(model_dir, world.device)
        old_values = algo.batched_values(critic, full, 8) + 0.1 * torch.randn(
            full.completion_ids.shape, generator=torch.Generator().manual_seed(2))
        mask = full.completion_mask.float()
        token_reward = algo.token_rewards(rewards, old_logprobs_full, ref_logprobs_full, mask, args.beta)
        advantages, returns = algo.gae_advantages(token_reward, old_values, mask, args.gamma, args.lam)
        advantages = algo.whiten(advantages[s], mask[s], world)
        policy, critic = common.parallelize(policy, world, args.system.fsdp), common.parallelize(critic, world,
                                                                                                 args.system.fsdp)
        optimizer = torch.optim.SGD(policy.parameters(), lr=args.learning_rate)
        critic_optimizer = torch.optim.SGD(critic.parameters(), lr=args.critic_learning_rate)
        algo.update_policy(policy, critic, optimizer, critic_optimizer, mine, advantages, returns[s],
                           old_logprobs_full[s], old_values[s], args, torch.Generator().manual_seed(0), world)
        trained.append(critic)
    else:
        policy = common.parallelize(policy, world, args.system.fsdp)  # DDP, or FSDP2 with fsdp=True
        optimizer = torch.optim.SGD(policy.parameters(), lr=args.learning_rate)
        algo.update_policy(policy, optimizer, mine, advantages[s], old_logprobs_full[s], ref_model,
                           args, torch.Generator().manual_seed(0), world)
    assert all(common.is_sharded(m) == (args.system.fsdp and world.enabled) for m in trained)
    full = [bookkeeping.full_state_dict(m) or common.unwrap(m).state_dict() for m in trained]  # gathers FSDP2 shards
    return torch.cat([t.detach().flatten() for sd in full for t in sd.values()]) if world.is_main else None


def main():
    algo_name, model_dir, out, configs = sys.argv[1:5]
    world = common.setup_distributed("cpu")  # one process group for all: every configuration wraps fresh models
    weights = {name: update(algo_name, model_dir, flags, world) for name, flags in json.loads(configs).items()}
    if world.is_main:
        torch.save(weights, out)
    common.cleanup_distributed()


if __name__ == "__main__":
    common.run_command(main)
