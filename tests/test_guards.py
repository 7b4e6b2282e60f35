"""Numerical guards and clear stops: NaN rewards never reach the weights, too many non-finite steps in a
row stop the run with a checkpoint of the last good weights, uninformative batches are harmless, and
out-of-memory names the flags to lower."""

import os

import pytest
import torch

import bookkeeping

import common
import dapo
import grpo
import ppo
from conftest import checkpoint_weights, constant_reward, read_metrics, script_args, tiny_args


def nan_reward(rollout, tasks):
    """NaN rewards in groups that are informative by accuracy (dynamic sampling keeps them)."""
    n = len(rollout.texts)
    return [float("nan")] * n, [float(i % 2) for i in range(n)], [1.0] * n


@pytest.mark.parametrize("algo", [grpo, dapo, ppo])
def test_nan_rewards_never_reach_the_weights_and_stop_the_run(algo, tiny_model_dir, tmp_path):
    # two minibatches: each optimizer step of a step is skipped and counted; the stop counts steps
    args = tiny_args(algo, model=tiny_model_dir, runs_dir=str(tmp_path), num_steps=5, num_minibatches=2,
                     max_skipped_steps=2)
    with pytest.raises(common.RunStopped,
                       match=r"2 steps in a row had a non-finite gradient \(--max-skipped-steps=2\)"):
        algo.train(args, reward_fn=nan_reward)
    run, rows = read_metrics(tmp_path)
    saved = checkpoint_weights(os.path.join(run, "checkpoint-2"))
    start = checkpoint_weights(tiny_model_dir)
    assert all(torch.equal(saved[k], start[k]) for k in start)  # the last good state: untouched
    n = args.num_minibatches  # every optimizer step of a step was skipped
    assert [r.get("charts/skipped_steps") for r in rows] == [None, n, 2 * n]  # step 0: the evaluation alone


@pytest.mark.parametrize("algo", [grpo, dapo])
@pytest.mark.parametrize("group_size", [2, 8])  # 8 x 0.1: a float32 mean and std that are not exact
def test_batches_where_every_group_has_equal_rewards_change_nothing(algo, group_size, tiny_model_dir, tmp_path):
    # zero advantages everywhere (and no KL term): a zero gradient, no NaN, no skipped step
    args = tiny_args(algo, model=tiny_model_dir, runs_dir=str(tmp_path), beta=0.0, num_steps=2, group_size=group_size,
                     num_minibatches=2)
    out = algo.train(args, reward_fn=constant_reward)
    assert out["charts/skipped_steps"] == 0 and out["charts/zero_std_fraction"] == 1.0
    saved = checkpoint_weights(os.path.join(out["run_dir"], "checkpoint-2"))
    start = checkpoint_weights(tiny_model_dir)
    assert all(torch.equal(saved[k], start[k]) for k in start)


@pytest.mark.parametrize("stage,flag", [("update", "--micro-batch-size"), ("generation", "--prompts-per-step")])
def test_out_of_memory_names_the_flag_to_lower(stage, flag):
    with pytest.raises(common.RunStopped, match=f"out of memory in the {stage} .*: lower {flag}"):
        with bookkeeping.out_of_memory_hint(stage, script_args(grpo)):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
