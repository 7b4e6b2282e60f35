"""dapo.py: equation 12 (clip-higher, token-level aggregation), dynamic sampling and overlong shaping
against hand-computed values, a learning test, and the update's independence from the split."""

import math

import pytest
import torch

import common
import dapo
import grpo
from conftest import (assert_same_update_for_any_split, checkpoint_weights, even_token_reward, one_token_loss,
                      read_metrics, tiny_args)


# ---- Eq. 12: clipped surrogate with clip-higher ---------------------------------------------------------
def dapo_one_token_loss(ratio: float, advantage: float, clip_low: float = 0.2, clip_high: float = 0.28):
    return one_token_loss(ratio, advantage, clip_low, clip_high, policy_loss=dapo.policy_loss)


def test_clip_higher_worked_example():
    # the worked example of GRPO's clipping (tests/test_grpo.py), with clip-higher: ratio 1.35, A = +1.43,
    # eps_high 0.28 -> objective 1.28 * A instead of 1.2 * A, and no gradient
    loss, grad, stats = dapo_one_token_loss(1.35, 1.43)
    assert loss == pytest.approx(-1.28 * 1.43, abs=1e-6)
    assert grad == 0.0 and stats["clipfrac"] == 1.0


def test_clip_higher_lets_a_ratio_grow_where_grpo_clips():
    # ratio 1.25, A = +1: GRPO (eps 0.2) clips at 1.2 with no gradient; DAPO's 1.28 bound keeps it.
    loss, grad, stats = dapo_one_token_loss(1.25, 1.0)
    assert loss == pytest.approx(-1.25, abs=1e-6)
    assert grad == pytest.approx(-1.25, abs=1e-6)  # d(-r A)/d log r
    assert stats["clipfrac"] == 0.0
    logprobs = torch.tensor([[math.log(1.25)]], requires_grad=True)
    grpo.policy_loss(logprobs, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), 0.2)[0].backward()
    assert logprobs.grad.item() == 0.0


def test_lower_clip():
    # ratio 0.7, A = -2.1: min(-1.47, 0.8 * -2.1 = -1.68) = -1.68, clipped, no gradient
    loss, grad, _ = dapo_one_token_loss(0.7, -2.1)
    assert loss == pytest.approx(1.68, abs=1e-6)
    assert grad == 0.0
    # with clip_low 0.4 the bound is 0.6, so 0.7 is inside: -1.47 and a gradient of -r A = 1.47
    loss, grad, _ = dapo_one_token_loss(0.7, -2.1, clip_low=0.4)
    assert loss == pytest.approx(1.47, abs=1e-6)
    assert grad == pytest.approx(1.47, abs=1e-5)


# ---- Eq. 12: token-level aggregation ----------------------------------------------------------------
def test_token_level_against_sample_level_aggregation():
    # Lengths 1 and 3, advantages +1 and -1, ratio 1. Token-level (eq. 12): -(1 - 3) / 4 = 0.5, every
    # token weighs 1/4. Sample-level (eq. 9): -(1 - 1) / 2 = 0, tokens weigh 1/(2 |o_i|).
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    advantages = torch.tensor([[1.0], [-1.0]])  # per sequence, on each of its tokens
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, _ = dapo.policy_loss(logprobs, torch.zeros(2, 3), advantages, mask, 0.2, 0.28)
    loss.backward()
    assert loss.item() == pytest.approx(0.5)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, 0, 0], [0.25, 0.25, 0.25]]))
    sample_level, _ = grpo.policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), advantages, mask, 0.2)
    assert sample_level.item() == pytest.approx(0.0, abs=1e-7)


def test_token_level_equals_sample_level_when_lengths_are_equal():
    g = torch.Generator().manual_seed(0)
    logprobs, old = torch.randn(4, 5, generator=g) * 0.1, torch.randn(4, 5, generator=g) * 0.1
    advantages, mask = torch.randn(4, 1, generator=g), torch.ones(4, 5)
    token_level, _ = dapo.policy_loss(logprobs, old, advantages, mask, 0.2, 0.2)
    sample_level, _ = grpo.policy_loss(logprobs, old, advantages, mask, 0.2)
    assert token_level.item() == pytest.approx(sample_level.item(), abs=1e-6)


def test_parts_divided_by_the_global_token_count_sum_to_the_whole():
    g = torch.Generator().manual_seed(1)
    logprobs, old = torch.randn(6, 4, generator=g) * 0.2, torch.randn(6, 4, generator=g) * 0.2
    advantages = torch.randn(6, 1, generator=g)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    whole, _ = dapo.policy_loss(logprobs, old, advantages, mask, 0.2, 0.28)
    n = mask.sum()
    parts = [dapo.policy_loss(logprobs[s], old[s], advantages[s], mask[s], 0.2, 0.28, num_tokens=n)[0]
             for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), abs=1e-6)
    # dividing each part by its own count instead gives a different (wrong) answer
    own = [dapo.policy_loss(logprobs[s], old[s], advantages[s], mask[s], 0.2, 0.28)[0].item()
           for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
    assert sum(own) / 3 != pytest.approx(whole.item(), abs=1e-3)


# ---- Overlong reward shaping ------------------------------------------------------------------------
def test_overlong_penalty_at_the_buffer_edges():
    # max_new_tokens 20, buffer 5: no penalty up to 15 tokens, then linear down to -penalty at 20
    lengths = torch.tensor([3.0, 15, 16, 17.5, 20])
    got = dapo.overlong_penalty(lengths, max_new_tokens=20, buffer=5, penalty=0.5)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.1, -0.25, -0.5])


# ---- Dynamic sampling -------------------------------------------------------------------------------
def generation_batches(accuracy_per_batch: list[list[float]]) -> list[dapo.GenerationBatch]:
    """Generation batches whose completions are right (1.0) or wrong (0.0) as given; rewards the same."""
    return [dapo.GenerationBatch([], None, torch.tensor(acc), acc, acc, 0.0) for acc in accuracy_per_batch]


def test_dynamic_sampling_keeps_informative_groups_in_order():
    # G = 2, 3 groups per batch. Batch 0 has one informative group (1); batch 1 has two (0 and 2).
    batches = generation_batches([[1.0, 1.0, 0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    assert dapo.dynamic_sampling(batches[:1], 3, 2, "accuracy") == [(0, 1, True), (0, 0, False), (0, 2, False)]
    assert dapo.dynamic_sampling(batches, 3, 2, "accuracy") == [(0, 1, True), (1, 0, True), (1, 2, True)]


def test_dynamic_sampling_does_not_keep_more_than_the_step_needs():
    batches = generation_batches([[0.0, 1.0] * 4])
    assert dapo.dynamic_sampling(batches, 3, 2, "accuracy") == [(0, 0, True), (0, 1, True), (0, 2, True)]


def test_dynamic_sampling_filters_on_the_chosen_metric():
    # all wrong, rewards differ by a shaping term: informative by reward, not by accuracy
    batch = dapo.GenerationBatch([], None, torch.tensor([0.1, 0.096, 0.1, 0.1]), [0.0] * 4, [1.0] * 4, 0.0)
    assert dapo.dynamic_sampling([batch], 2, 2, "accuracy") == [(0, 0, False), (0, 1, False)]
    assert dapo.dynamic_sampling([batch], 2, 2, "reward") == [(0, 0, True), (0, 1, False)]


def test_training_batch_takes_the_selected_groups():
    rollouts = [common.Rollout(torch.ones(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.long),
                               torch.arange(4 * n).view(4, n), torch.ones(4, n, dtype=torch.long),
                               [f"b{b}r{r}" for r in range(4)], ["stop"] * 4) for b, n in ((0, 3), (1, 5))]
    batches = [dapo.GenerationBatch([], rollouts[b], torch.tensor([0.0, 1.0, 2.0, 3.0]) + 10 * b, [], [], 0.0)
               for b in range(2)]
    rollout, rewards, kept = dapo.training_batch(batches, [(1, 1, True), (0, 0, False)], 2, pad_token_id=0)
    assert rollout.texts == ["b1r2", "b1r3", "b0r0", "b0r1"]
    assert rewards.tolist() == [12.0, 13.0, 0.0, 1.0]
    assert kept.tolist() == [True, True, False, False]
    assert rollout.completion_mask.sum(-1).tolist() == [5, 5, 3, 3]  # shorter batch padded on the right


# ---- Learning and the split ------------------------------------------------------------------------
def test_dapo_learns_a_toy_reward(peaked_model_dir, tmp_path):
    dynamic_sampling = True  # DAPO as defined; with it off the loop is GRPO's with eq. 12
    args = tiny_args(dapo, model=peaked_model_dir, num_steps=20, prompts_per_step=4, group_size=8, max_new_tokens=8,
                     learning_rate=3e-3, num_minibatches=2, micro_batch_size=32, runs_dir=str(tmp_path), seed=1,
                     dynamic_sampling=dynamic_sampling,
                     dynamic_sampling_metric="reward")  # "accuracy" (all tokens even) is rare at first
    out = dapo.train(args, reward_fn=even_token_reward)
    rows = read_metrics(out["run_dir"])[1][1:]  # after step 0
    rewards = [r["charts/reward"] for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert first < 0.65, rewards
    assert last > 0.85, rewards
    assert all(r["charts/generation_batches"] >= 1 for r in rows)


def test_update_is_the_same_for_any_split(tiny_model_dir, tmp_path):
    # token-level normalisation by the global count: micro-batches of 3 + 1 per process agree too
    assert_same_update_for_any_split("dapo", tiny_model_dir, tmp_path, 3, ent_coef=0.01)


# ---- Mini-batches make clipping act; one on-policy minibatch cannot clip -----------------------------
def one_step(model_dir, tmp_path, name, **flags):
    args = tiny_args(dapo, model=model_dir, prompts_per_step=4, group_size=8, max_new_tokens=8, micro_batch_size=32,
                     runs_dir=str(tmp_path / name), seed=1, dynamic_sampling=False, **flags)
    out = dapo.train(args, reward_fn=even_token_reward)
    return out, checkpoint_weights(f"{out['run_dir']}/checkpoint-1")


def test_minibatches_make_clip_higher_act_and_one_minibatch_does_not(peaked_model_dir, tmp_path):
    # (a learning rate at which some ratios land in (1.2, 1.28]; much larger and they overshoot both bounds)
    out, low = one_step(peaked_model_dir, tmp_path, "a", num_minibatches=4, clip_high=0.2)
    higher, high = one_step(peaked_model_dir, tmp_path, "b", num_minibatches=4, clip_high=0.28)
    assert 0 < higher["losses/clipfrac"] <= out["losses/clipfrac"]  # clip-higher clips no more tokens
    assert any(not torch.equal(low[k], high[k]) for k in low)
    # one minibatch of one epoch: the ratio is exactly 1, so the clip range cannot matter
    out, low = one_step(peaked_model_dir, tmp_path, "c", num_minibatches=1, clip_high=0.2)
    _, high = one_step(peaked_model_dir, tmp_path, "d", num_minibatches=1, clip_high=0.28)
    assert out["losses/clipfrac"] == 0
    assert all(torch.equal(low[k], high[k]) for k in low)


# ---- Dynamic sampling filters on accuracy, as DAPO defines it ----------------------------------------
def format_only_reward(rollout, tasks):
    """All wrong, well-formed, rewards that differ only by a shaping term (0.1 vs 0.096)."""
    n = len(rollout.texts)
    return [0.1 if i % 8 else 0.096 for i in range(n)], [0.0] * n, [1.0] * n


@pytest.mark.parametrize("metric,dropped", [("accuracy", 1.0), ("reward", 0.0)])
def test_dynamic_sampling_metric(metric, dropped, tiny_model_dir, tmp_path):
    args = tiny_args(dapo, model=tiny_model_dir, group_size=8, runs_dir=str(tmp_path), max_generation_batches=2,
                     dynamic_sampling_metric=metric)
    out = dapo.train(args, reward_fn=format_only_reward)
    assert out["charts/dropped_fraction"] == dropped
    assert out["charts/generation_batches"] == (2 if metric == "accuracy" else 1)
