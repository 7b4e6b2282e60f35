"""grpo.py: equations 9, 10 and 11 against hand-computed values, a learning test, and the update's
independence from how the batch is split over micro-batches and processes."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import common
import grpo
from conftest import assert_same_update_for_any_split, even_token_reward, one_token_loss, read_metrics, tiny_args


# ---- Eq. 10: group-relative advantages -------------------------------------------------------------
def test_advantages_match_the_worked_example():
    # the worked example of GRPO's advantage (eq. 10): one group of rewards 2, 10, 3; mean 5; population std
    # sqrt(38/3) = 3.559 ("about 3.5"); advantages about -0.86, 1.43, -0.57
    adv = grpo.group_advantages(torch.tensor([2.0, 10.0, 3.0]), group_size=3)
    std = math.sqrt(38 / 3)
    assert adv.tolist() == pytest.approx([-3 / std, 5 / std, -2 / std], abs=1e-5)
    assert adv.tolist() == pytest.approx([-0.86, 1.43, -0.57], abs=0.03)  # the example's rounded values


def test_advantages_are_per_group_and_zero_for_identical_rewards():
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.1])
    adv = grpo.group_advantages(rewards, group_size=4)
    # first group: mean 0.75, population std sqrt(3)/4
    std = math.sqrt(3) / 4
    assert adv[:4].tolist() == pytest.approx([-0.75 / std] + [0.25 / std] * 3, abs=1e-5)
    assert torch.isfinite(adv).all()
    assert adv[4:].tolist() == [0.0] * 4  # identical rewards: zero, not NaN
    assert grpo.group_advantages(torch.tensor([0.0, 1.0]), 2).tolist() == pytest.approx([-1, 1], abs=1e-5)


# ---- Eq. 11: k3 estimator of KL(pi || pi_ref) -------------------------------------------------------
def test_kl_k3_values():
    logprobs = torch.log(torch.tensor([0.5, 0.2, 0.3]))
    ref = torch.log(torch.tensor([0.25, 0.2, 0.6]))
    # pi_ref/pi - log(pi_ref/pi) - 1: 0.5 + log 2 - 1 ; 0 ; 2 - log 2 - 1
    expected = [0.5 + math.log(2) - 1, 0.0, 2 - math.log(2) - 1]
    assert grpo.kl_k3(logprobs, ref).tolist() == pytest.approx(expected, abs=1e-6)
    assert (grpo.kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


# ---- Eq. 9: clipped surrogate, sample-level ---------------------------------------------------------
def test_clip_upper_bound_with_positive_advantage():
    # the worked example of GRPO's clipping (eq. 9): ratio 1.35, A = +1.43 (the advantage of reward 10 above),
    # eps 0.2 -> objective clip(1.35) * A = 1.2 * 1.43, no gradient
    loss, grad, stats = one_token_loss(1.35, 1.43)
    assert loss == pytest.approx(-1.2 * 1.43, abs=1e-6)
    assert grad == 0.0 and stats["clipfrac"] == 1.0


def test_clip_lower_bound_with_negative_advantage():
    # the worked example of PPO's clipping, checked against eq. 1: ratio 0.7, A = -2.1:
    # min(0.7 * -2.1, 0.8 * -2.1) = min(-1.47, -1.68) = -1.68, the clipped term, so no gradient.
    loss, grad, _ = one_token_loss(0.7, -2.1)
    assert loss == pytest.approx(1.68, abs=1e-6)
    assert grad == 0.0


def test_unclipped_side_keeps_its_gradient():
    # ratio 1.35 with a negative advantage: min(-2.835, -2.52) = -2.835 (unclipped, pessimistic)
    loss, grad, stats = one_token_loss(1.35, -2.1)
    assert loss == pytest.approx(1.35 * 2.1, abs=1e-6)
    assert grad == pytest.approx(1.35 * 2.1, abs=1e-5)  # d(-r A)/d log r = -r A
    assert stats["clipfrac"] == 0.0


def test_truncated_importance_weights_scale_each_token_of_the_surrogate():
    # --vllm-importance-cap 2: ratio 1, A = +1 on two tokens of one sequence; the engine gave them log-probs
    # ln 2 and ln 1/3 above pi_old's (0): weights min(0.5, 2) and min(3, 2) -> -(0.5 + 2) / 2
    logprobs = torch.zeros(1, 2, requires_grad=True)
    engine = torch.tensor([[math.log(2.0), math.log(1 / 3)]])
    adv, gap = grpo.engine_correction(torch.tensor([1.0]), torch.zeros(1, 2), engine, cap=2.0)
    loss, stats = grpo.policy_loss(logprobs, torch.zeros(1, 2), adv, torch.ones(1, 2), 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-1.25)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, -1.0]]))
    assert grpo.sequence_mean(gap, torch.ones(1, 2)).item() == pytest.approx((math.log(2) + math.log(3)) / 2)
    same, off_gap = grpo.engine_correction(torch.tensor([1.0]), torch.zeros(1, 2), engine, cap=0.0)
    unweighted, _ = grpo.policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), same, torch.ones(1, 2), 0.2)
    assert unweighted.item() == pytest.approx(-1.0) and torch.equal(off_gap, gap)  # cap 0: the gap, no weights


def test_sample_level_aggregation_weights_each_sequence_equally():
    # Two sequences, lengths 1 and 3, advantages +1 and -1, ratio 1: eq. 9 averages tokens within each
    # sequence, then sequences: (1 + (-1)) / 2 = 0. Token-level would give (1 - 3) / 4 = -0.5.
    logprobs = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    loss, stats = grpo.policy_loss(logprobs, torch.zeros(2, 3), torch.tensor([[1.0], [-1.0]]), mask, 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    # d loss / d logprob_{i,t} = -A_i / (|o_i| * G)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, 0, 0], [1 / 6, 1 / 6, 1 / 6]]))


# ---- Learning: a tiny model improves on a toy reward ------------------------------------------------
def test_grpo_learns_a_toy_reward(peaked_model_dir, tmp_path):
    args = tiny_args(grpo, model=peaked_model_dir, num_steps=20, prompts_per_step=4, group_size=8, max_new_tokens=8,
                     num_minibatches=2, beta=0.0, micro_batch_size=32, runs_dir=str(tmp_path), seed=1)
    out = grpo.train(args, reward_fn=even_token_reward)
    _, rows = read_metrics(out["run_dir"])
    rewards = [r["charts/reward"] for r in rows if r["step"] >= 1]  # step 0 is the starting model's evaluation
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert first < 0.65, rewards
    assert last > 0.85, rewards  # the fraction of even tokens went from ~0.5 to nearly all


# ---- The update does not depend on the split ----------------------------------------------------------
def test_update_is_the_same_for_any_split(tiny_model_dir, tmp_path):
    start = torch.cat([t.flatten() for t in common.load_model(tiny_model_dir,
                                                              torch.device("cpu")).state_dict().values()])
    one_process = assert_same_update_for_any_split("grpo", tiny_model_dir, tmp_path, 2,
                                                   extra_one_process={"accumulated": dict(micro_batch_size=1)})
    whole = one_process["whole"]
    assert (whole - start).abs().max() > 1e-2  # the update moved the weights
    torch.testing.assert_close(one_process["accumulated"], whole, atol=2e-6, rtol=1e-4)


# ---- Equal rewards: exactly zero advantage at any group size, value and dtype -------------------------
@settings(max_examples=200, deadline=None)
@given(group_size=st.integers(2, 64), value=st.floats(-100, 100, allow_nan=False, width=32),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), other=st.floats(-100, 100, width=32))
def test_groups_of_equal_rewards_get_exactly_zero_advantage(group_size, value, dtype, other):
    # three groups: equal rewards; equal but the last, moved by at least 1/64 of the value (bfloat16's spacing is
    # at most 1/128 of it) so that it differs in either dtype; equal but the last, `other` (equal or not once rounded)
    apart = value + max(abs(value) / 64, 0.01)
    rewards = torch.tensor([value] * group_size + [value] * (group_size - 1) + [apart]
                           + [value] * (group_size - 1) + [other]).to(dtype)
    adv = grpo.group_advantages(rewards, group_size)
    equal = grpo.equal_reward_groups(rewards, group_size).tolist()
    assert adv[:group_size].tolist() == [0.0] * group_size and equal[0] is True
    assert equal[1] is False and (adv[group_size:2 * group_size] != 0).any()  # a reward that differs: a signal
    if other == value or dtype == torch.float32:  # both drawn as float32 values: float32 keeps them as they are
        assert equal[2] is (other == value)
    assert equal[2] is bool((adv[2 * group_size:] == 0).all())  # no signal exactly where the group counts as equal
    assert torch.isfinite(adv).all()


def test_eight_rewards_of_a_tenth_are_the_hard_case():
    # float32 round-off: the mean of [0.1] * 8 is not 0.1, so (r - mean) / (std + eps) was -0.0075
    rewards = torch.full((8,), 0.1)
    assert rewards.mean() != rewards[0]
    assert grpo.group_advantages(rewards, 8).tolist() == [0.0] * 8


# ---- Garbage at padded positions changes nothing ------------------------------------------------------
@pytest.mark.parametrize("garbage", [95.0, -95.0, float("inf"), float("-inf")])
def test_garbage_in_padding_changes_neither_loss_nor_gradient(garbage):
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]])
    clean = torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-0.5, -1.5, -0.3, -2.0]])
    old, ref = clean - 0.1, clean + 0.2
    results = []
    for padding in (0.0, garbage):
        logprobs = torch.where(mask.bool(), clean, padding).requires_grad_(True)
        loss, stats = grpo.policy_loss(logprobs, old, torch.tensor([[1.0], [-1.0]]), mask, 0.2)
        kl = grpo.sequence_mean(grpo.kl_k3(logprobs, ref), mask)
        (loss + 0.1 * kl).backward()
        results.append((loss.item(), kl.item(), logprobs.grad.clone(), stats["clipfrac"]))
    assert results[1][:2] == results[0][:2] and results[1][3] == results[0][3]
    assert torch.equal(results[1][2], results[0][2]) and torch.isfinite(results[1][2]).all()


def test_kl_k3_is_clamped_where_exp_would_overflow():
    kl = grpo.kl_k3(torch.tensor([0.0, -200.0]), torch.tensor([0.0, 0.0]))
    assert kl.tolist() == [0.0, grpo.KL_LIMIT]
