"""ppo.py: GAE (eq. 21-22), the KL penalty in the reward (eq. 8), the clipped value loss (eq. 26), the
entropy (eq. 5) and the clipped objective (eq. 7) against hand-computed values; a learning test; the
update's independence from the split."""

import math

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutput

import common
import ppo
from conftest import assert_same_update_for_any_split, even_token_reward, read_metrics, tiny_args

REWARDS = torch.tensor([[0.0, 0.0, 1.0]])
VALUES = torch.tensor([[0.5, 0.2, 0.4]])
FULL = torch.ones(1, 3)


# ---- GAE (eq. 21-22) --------------------------------------------------------------------------------
def test_gae_lambda_one_is_return_minus_value():
    # eq. 28: lambda = gamma = 1 gives A_t = R_t - V_t with R_t the sum of future rewards (1 for every t)
    adv, ret = ppo.gae_advantages(REWARDS, VALUES, FULL, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.6]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_lambda_zero_is_the_td_error():
    # eq. 22: delta_t = r_t + gamma V_{t+1} - V_t, with V after the last token = 0
    adv, ret = ppo.gae_advantages(REWARDS, VALUES, FULL, gamma=1.0, lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.2 - 0.5, 0.4 - 0.2, 1.0 - 0.4]]))
    torch.testing.assert_close(ret, adv + VALUES)


def test_gae_discounting():
    # gamma 0.5, lambda 1: discounted returns 0.25, 0.5, 1 minus the values
    adv, _ = ppo.gae_advantages(REWARDS, VALUES, FULL, gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.25 - 0.5, 0.5 - 0.2, 1.0 - 0.4]]))
    # gamma 1, lambda 0.5: A_2 = 0.6, A_1 = 0.2 + 0.5 * 0.6 = 0.5, A_0 = -0.3 + 0.5 * 0.5 = -0.05
    adv, _ = ppo.gae_advantages(REWARDS, VALUES, FULL, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[-0.05, 0.5, 0.6]]))


def test_gae_ends_each_completion_at_its_last_valid_token():
    # a completion of 2 tokens padded to 3: the padding's value 9 and reward 5 must not leak in
    rewards = torch.tensor([[0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.2, 9.0]])
    adv, ret = ppo.gae_advantages(rewards, values, torch.tensor([[1.0, 1.0, 0.0]]), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0]]))


# ---- Eq. 8: the KL penalty in the reward ------------------------------------------------------------
def test_kl_penalty_on_every_token_and_score_on_the_last():
    logprobs = torch.log(torch.tensor([[0.5, 0.4, 0.2], [0.3, 0.9, 0.9]]))
    ref = torch.log(torch.tensor([[0.25, 0.4, 0.4], [0.6, 0.9, 0.9]]))
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    got = ppo.token_rewards(torch.tensor([1.0, 0.1]), logprobs, ref, mask, beta=0.1)
    expected = torch.tensor([[-0.1 * math.log(2), 0.0, -0.1 * math.log(0.5) + 1.0],
                             [-0.1 * math.log(0.5) + 0.1, 0.0, 0.0]])
    torch.testing.assert_close(got, expected)


# ---- Eq. 26: clipped value loss ---------------------------------------------------------------------
def one_value_loss(value: float, old: float, ret: float, clip: float = 0.2):
    v = torch.tensor([[value]], requires_grad=True)
    loss, stats = ppo.value_loss(v, torch.tensor([[old]]), torch.tensor([[ret]]), torch.ones(1, 1), clip)
    loss.backward()
    return loss.item(), v.grad.item(), stats["value_clipfrac"]


def test_value_clipping_takes_the_larger_error():
    # V 1.0 moved away from V_old 0.5 past the clip (0.7), return 2: unclipped (1 - 2)^2 = 1,
    # clipped (0.7 - 2)^2 = 1.69 -> 1.69, and clip() is flat there: no gradient
    loss, grad, clipfrac = one_value_loss(1.0, 0.5, 2.0)
    assert loss == pytest.approx(1.69) and grad == 0.0 and clipfrac == 1.0
    # return 0: unclipped 1, clipped 0.49 -> 1, gradient 2 (V - R)
    loss, grad, clipfrac = one_value_loss(1.0, 0.5, 0.0)
    assert loss == pytest.approx(1.0) and grad == pytest.approx(2.0) and clipfrac == 0.0
    # the other side: V 0.0 below V_old 0.5 - 0.2, return 1: (0 - 1)^2 = 1 vs (0.3 - 1)^2 = 0.49 -> 1
    loss, grad, _ = one_value_loss(0.0, 0.5, 1.0)
    assert loss == pytest.approx(1.0) and grad == pytest.approx(-2.0)


# ---- Eq. 7: clipped objective with per-token advantages ----------------------------------------------
def test_ppo_clipping_worked_example():
    # the worked example of PPO's clipping: ratio 0.7, A = -2.1, eps 0.2: min(-1.47, -1.68) = -1.68, clipped,
    # no gradient
    logprobs = torch.tensor([[math.log(0.7)]], requires_grad=True)
    loss, stats = ppo.policy_loss(logprobs, torch.zeros(1, 1), torch.tensor([[-2.1]]), torch.ones(1, 1), 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(1.68, abs=1e-6)
    assert logprobs.grad.item() == 0.0 and stats["clipfrac"] == 1.0


def test_token_level_loss_with_per_token_advantages():
    # ratio 1 everywhere; advantages per token; lengths 1 and 2: -(1 + (-2) + 4) / 3 = -1
    mask = torch.tensor([[1.0, 0], [1, 1]])
    adv = torch.tensor([[1.0, 7.0], [-2.0, 4.0]])  # 7 sits on padding and must be ignored
    loss, _ = ppo.policy_loss(torch.zeros(2, 2), torch.zeros(2, 2), adv, mask, 0.2)
    assert loss.item() == pytest.approx(-1.0)


# ---- Eq. 4-5: entropy of a known distribution ----------------------------------------------------------
class FixedDistribution(torch.nn.Module):
    """A 'language model' whose next-token distribution is the same fixed one at every position."""

    def __init__(self, probs):
        super().__init__()
        self.logits = torch.log(torch.tensor(probs))

    def forward(self, input_ids, logits_to_keep=0, **_):
        logits = self.logits.expand(*input_ids.shape, -1)
        return CausalLMOutput(logits=logits[:, -logits_to_keep:])


@pytest.mark.parametrize("probs,expected", [([0.25] * 4, math.log(4)), ([0.5, 0.25, 0.25], 1.5 * math.log(2))])
def test_entropy_of_a_known_distribution(probs, expected):
    model = FixedDistribution(probs)
    ids = torch.zeros(2, 3, dtype=torch.long)
    logprobs, entropy = common.completion_logprobs(model, ids, torch.ones_like(ids), ids, torch.ones_like(ids),
                                                   with_entropy=True)
    torch.testing.assert_close(entropy, torch.full((2, 3), expected))
    torch.testing.assert_close(logprobs, torch.full((2, 3), math.log(probs[0])))


# ---- Whitening over processes --------------------------------------------------------------------------
def test_whiten_uses_only_valid_tokens():
    values = torch.tensor([[1.0, 3.0, 100.0]])
    got = ppo.whiten(values, torch.tensor([[1.0, 1.0, 0.0]]), common.Dist())
    torch.testing.assert_close(got, torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-6, rtol=0)


# ---- Learning and the split ------------------------------------------------------------------------------
def test_ppo_learns_a_toy_reward_and_its_critic_improves(peaked_model_dir, tmp_path):
    args = tiny_args(ppo, model=peaked_model_dir, num_steps=20, prompts_per_step=16, max_new_tokens=8,
                     learning_rate=3e-3, num_minibatches=2, critic_learning_rate=1e-3, critic_warmup_steps=2, beta=0.0,
                     micro_batch_size=32, runs_dir=str(tmp_path), seed=1)
    out = ppo.train(args, reward_fn=even_token_reward)
    _, rows = read_metrics(out["run_dir"])  # rows[0]: step 0
    rewards = [r["charts/reward"] for r in rows[1:]]
    assert sum(rewards[:3]) / 3 < 0.65, rewards
    assert sum(rewards[-5:]) / 5 > 0.85, rewards
    assert "losses/policy_loss" not in rows[2] and "losses/policy_loss" in rows[3]  # critic warm-up: 2 steps
    value_losses = [r["losses/value_loss"] for r in rows[1:]]
    assert sum(value_losses[-5:]) / 5 < 0.5 * sum(value_losses[:3]) / 3, value_losses


def test_update_is_the_same_for_any_split(tiny_model_dir, tmp_path):
    # the actor's and the critic's weights, micro-batches of 3 + 1 per process
    assert_same_update_for_any_split("ppo", tiny_model_dir, tmp_path, 3, ent_coef=0.01)
