"""Paper: "Comparative Analysis and Parametric Tuning of PPO, GRPO, and DAPO for LLM Reasoning Enhancement"
(arXiv:2512.07611, https://arxiv.org/abs/2512.07611).

PPO on the Countdown game: paper section 2.1 and appendix C, equations 3-5 (loss, entropy), 7 (clipped
objective), 8 (KL penalty in the reward), 21-22 (GAE) and 26 (clipped value loss).

An actor and a learned critic (the same base model with a scalar head on every token). The Countdown
score is the reward of the last token, every token pays -beta * log(pi/pi_ref), GAE turns rewards and
values into per-token advantages, and the loss is token-level as in the paper's Table 1.

    python ppo.py                                              # bundled SmolLM2-135M, CPU, offline
    python ppo.py --model Qwen/Qwen2.5-1.5B-Instruct ...       # the paper's model, GPU
    torchrun --nproc_per_node=N ppo.py ...                     # data-parallel on N processes

Read top to bottom: Args, the algorithm's functions (imported by tests), then the loop, cut into
rollout, reward, advantages, log-probs, update and logging. README.md maps every equation to its lines.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import tyro

import bookkeeping

import common

SCRIPT = Path(__file__).stem  # "ppo": names the run folder and its records, checked on --resume


@dataclass
class Args:
    # Experiment
    exp_name: str = SCRIPT
    """name of this experiment; the run folder is `<runs_dir>/<exp_name>__<seed>__<unix time>`"""
    seed: int = 1
    """seed of the data order, sampling and initialisation"""
    model: str = common.WARM_MODEL
    """`bundled-warm` (SmolLM2-135M-Instruct after a format-only warm start, made once), `bundled` (untrained: in
    48 new tokens it almost never writes a well-formed answer), a local HF folder, or a hub id
    (Qwen/Qwen2.5-1.5B-Instruct)"""
    dataset: str = "generated"
    """`generated` (offline, solvable tasks), a .jsonl/.parquet file with nums and target, or a hub id
    (Jiayi-Pan/Countdown-Tasks-3to4)"""
    num_steps: int = 60
    """training steps (one generation batch each)"""

    # The algorithm's hyper-parameters (the ones the paper varies)
    prompts_per_step: int = 32
    """prompts per step over all processes (32 x 1 = GRPO's default 16 x 2 completions per step)"""
    group_size: int = 1
    """completions sampled per prompt (verl's rollout.n); PPO needs no group, the critic is its baseline"""
    learning_rate: float = 1e-5
    """actor AdamW learning rate (paper 3.2: 1e-6 is stable, larger learns faster and fluctuates)"""
    critic_learning_rate: float = 1e-4
    """critic AdamW learning rate"""
    critic_warmup_steps: int = 0
    """first steps in which only the critic learns (the actor waits for useful values)"""
    warmup_steps: int = 0
    """linear learning-rate warm-up, in training steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    clip_eps: float = 0.2
    """epsilon of the clipped ratio (eq. 7)"""
    beta: float = 0.001
    """KL coefficient of the per-token penalty in the reward (eq. 8; verl's `kl_ctrl.kl_coef` default, which acts only
    with `use_kl_in_reward=true`). 0 skips the reference model"""
    gamma: float = 1.0
    """discount factor of GAE (eq. 21-22)"""
    lam: float = 1.0
    """GAE lambda (eq. 21): 1 gives Monte Carlo returns minus values, 0 the one-step TD error"""
    whiten_advantages: bool = True
    """normalise advantages to mean 0, std 1 over the batch (all processes), as verl's GAE does"""
    clip_value: float = 0.2
    """epsilon of the clipped value loss (eq. 26)"""
    vf_coef: float = 0.5
    """c1 of eq. 3 (value-loss weight); the critic has its own optimizer, so it mostly scales its gradient"""
    ent_coef: float = 0.0
    """c2 of eq. 3 (entropy bonus, eq. 4-5); paper 3.1: a bonus explores more but lowered accuracy"""
    update_epochs: int = 1
    """passes over each generation batch"""
    num_minibatches: int = 2
    """optimizer steps per pass, each on 1/N of the batch (verl's ppo_mini_batch_size = prompts-per-step / N).
    After the first, pi_theta has moved from pi_old and clipping acts; 1 epoch of 1 minibatch is on-policy:
    ratio 1, no clipping"""
    max_grad_norm: float = 1.0
    """gradient clipping norm (actor and critic separately)"""

    # Shared sections, the same in every script; their flags have no prefix (--max-new-tokens, --micro-batch-size)
    task: tyro.conf.OmitArgPrefixes[common.TaskArgs] = field(default_factory=common.TaskArgs)
    """generation, reward and data"""
    system: tyro.conf.OmitArgPrefixes[common.SystemArgs] = field(default_factory=common.SystemArgs)
    """devices, precision, memory, vLLM, sharding"""
    log: tyro.conf.OmitArgPrefixes[bookkeeping.LogArgs] = field(default_factory=bookkeeping.LogArgs)
    """logging, checkpoints, resume"""


# ----------------------------------------------------------------------------------------------------
# The critic: V(s_t) for every completion token
# ----------------------------------------------------------------------------------------------------
def load_value_model(path: str, device: torch.device, gradient_checkpointing: bool = False,
                     dtype: torch.dtype = torch.float32):
    """PPO's critic: the same pretrained backbone with a new scalar head on every token
    (AutoModelForTokenClassification, num_labels=1, as verl does); no dropout in the head; float32
    weights and a `dtype` forward, as load_model."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    common.quiet_transformers()  # the new head is "newly initialized", as intended
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # dropout would make V differ between the rollout and the update
    model = common.pretrained_or_sharded(AutoModelForTokenClassification, path, config=config).to(device)
    common.disable_dropout(model)
    model.eval()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return common.autocast_forward(model, dtype)


def completion_values(critic, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """V(s_t) (B, T) for every completion token t: the critic's output at the position that predicts
    token t, i.e. after the prompt and o_<t (the same positions as the log-probs)."""
    input_ids, attention_mask, position_ids = common.model_inputs(prompt_ids, prompt_mask, completion_ids,
                                                                  completion_mask)
    T = completion_ids.shape[1]
    out = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.logits[:, -(T + 1):-1, 0].float()


@torch.no_grad()
def batched_values(critic, rollout: common.Rollout, micro_batch_size: int) -> torch.Tensor:
    """completion_values over the whole rollout in micro-batches, without gradients."""
    return common.over_micro_batches(lambda *batch: completion_values(common.unwrap(critic), *batch), rollout,
                                     micro_batch_size)


# ----------------------------------------------------------------------------------------------------
# PPO's mathematics
# ----------------------------------------------------------------------------------------------------
LOG_RATIO_LIMIT = 20.0
"""log-ratios are clamped to +-this before exp: e^20 is large but finite, e^95 * 0 would be NaN"""


def token_rewards(scores: torch.Tensor, logprobs, ref_logprobs, mask, beta: float) -> torch.Tensor:
    """Eq. 8 per token: r_t = -beta * log(pi(o_t) / pi_ref(o_t)), plus the Countdown score on the last
    valid token of each completion. scores: (B,); logprobs, ref_logprobs, mask: (B, T)."""
    rewards = torch.where(mask.bool(), -beta * (logprobs - ref_logprobs), 0.0)
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    return rewards.scatter_add(-1, last.unsqueeze(-1), scores.unsqueeze(-1).to(rewards.dtype))


def kl_to_reference(logprobs, ref_logprobs, mask) -> torch.Tensor:
    """Logged only (eq. 8 charges the KL per token in the reward): the k3 estimate of KL(pi || pi_ref),
    pi_ref/pi - log(pi_ref/pi) - 1 per token, mean over each completion, then over completions, as grpo.py's
    `losses/kl_ref`, so that the paper's KL panels compare all three algorithms."""
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    per_token = torch.where(mask.bool(), (torch.exp(log_ratio) - log_ratio - 1).clamp(max=10.0), 0.0)  # verl's bound
    return (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def gae_advantages(rewards, values, mask, gamma: float, lam: float):
    """Eq. 21-22: A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, over each
    completion's tokens; the value after the last valid token is 0 (the episode ends). Returns
    (advantages, returns = advantages + values), both (B, T) and 0 on padding."""
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
        next_value = values[:, t] * mask[:, t]
    return advantages, (advantages + values) * mask


def whiten(values: torch.Tensor, mask: torch.Tensor, world: common.Dist, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the valid tokens of the whole batch, all processes together."""
    n, total, total_sq = common.all_reduce_sum(
        [mask.sum().item(), (values * mask).sum().item(), (values.pow(2) * mask).sum().item()], world)
    mean = total / max(n, 1)
    var = max(total_sq / max(n, 1) - mean**2, 0.0)
    return (values - mean) / (var + eps) ** 0.5 * mask


def token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None) -> torch.Tensor:
    """Token-level aggregation (PPO, Table 1): the sum over every valid token divided by the number of
    tokens. `num_tokens` is the count of the whole batch when this is one micro-batch or one process's
    share of it; default: this mask's count."""
    if num_tokens is None:
        num_tokens = mask.sum().clamp(min=1)
    return torch.where(mask.bool(), values, 0.0).sum() / num_tokens


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps: float, num_tokens: float | None = None):
    """Minus eq. 7's clipped surrogate, token-level aggregation.

    logprobs, old_logprobs, advantages, mask: (B, T); advantages are per token (GAE).
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    surrogate = torch.min(unclipped, clipped)
    loss = -token_mean(surrogate, mask, num_tokens)
    with torch.no_grad():
        stats = {
            "surrogate": token_mean(surrogate, mask, num_tokens).item(),
            "clipfrac": token_mean((clipped < unclipped).to(mask.dtype), mask, num_tokens).item(),
            "approx_kl": token_mean(torch.exp(log_ratio) - 1 - log_ratio, mask, num_tokens).item(),  # k3 to old
            "ratio": token_mean(ratio, mask, num_tokens).item(),
        }
    return loss, stats


def value_loss(values, old_values, returns, mask, clip_value: float, num_tokens: float | None = None):
    """Eq. 26: max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2), token-level. (B, T) tensors."""
    mask = mask.to(values.dtype)
    unclipped = (values - returns) ** 2
    clipped = (torch.clamp(values, old_values - clip_value, old_values + clip_value) - returns) ** 2
    loss = token_mean(torch.max(unclipped, clipped), mask, num_tokens)
    with torch.no_grad():
        stats = {"value_clipfrac": token_mean((clipped > unclipped).to(mask.dtype), mask, num_tokens).item()}
    return loss, stats


# ----------------------------------------------------------------------------------------------------
# vLLM's truncated importance sampling (--backend vllm): the sampler is not exactly pi_old
# ----------------------------------------------------------------------------------------------------
def engine_correction(advantages, old_logprobs, engine_logprobs, cap: float):
    """vLLM sampled the tokens from pi_vllm (other kernels, maybe another precision), not from pi_old.
    Returns the per-token gap |log pi_old - log pi_vllm| (logged) and, with cap > 0, the advantages
    weighted per token by min(pi_old / pi_vllm, cap): truncated importance sampling. Weighting the
    advantage weights the clipped surrogate: min(r A, clip(r) A) w = min(r A w, clip(r) A w) for w >= 0."""
    gap = (old_logprobs - engine_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if cap > 0:
        advantages = advantages * gap.exp().clamp(max=cap)  # (B, 1) or (B, T) -> per token
    return advantages, gap.abs()


# ----------------------------------------------------------------------------------------------------
# Update: update_epochs passes of num_minibatches optimizer steps, each accumulated over micro-batches
# ----------------------------------------------------------------------------------------------------
def update_policy(policy, critic, optimizer, critic_optimizer, rollout: common.Rollout, advantages, returns,
                  old_logprobs, old_values, args: Args, update_rng: torch.Generator, world: common.Dist,
                  train_actor: bool = True) -> tuple[dict, int]:
    """Minimise eq. 3: -eq. 7 + vf_coef * eq. 26 - ent_coef * entropy (eq. 4-5), token-level. Returns the
    update's means under their logged names, and how many optimizer steps a non-finite gradient skipped.

    Minibatches come from one permutation of every process's rows, and each process trains on an equal
    slice of each. Each micro-batch divides its token sums by the token count of the whole minibatch (over
    the number of processes, which DDP's gradient average divides out), so the update does not depend on
    how the batch is split over micro-batches and processes. Without `train_actor` only the critic learns.
    """
    # every process's rows: the minibatches are slices of one permutation of them all
    rollout, advantages, returns, old_logprobs, old_values = common.all_gather_rows(
        world, rollout, advantages, returns, old_logprobs, old_values)
    mask = rollout.completion_mask.to(torch.float32)
    batch_size = len(advantages)
    means: dict[str, float] = {}
    skipped = 0
    policy.train()
    critic.train()
    for _ in range(args.update_epochs):
        for minibatch in torch.randperm(batch_size, generator=update_rng).chunk(args.num_minibatches):
            rows = minibatch.chunk(world.world_size)[world.rank]  # this process's slice of the minibatch
            num_tokens = mask[minibatch].sum().item() / world.world_size  # DDP averages over processes
            optimizer.zero_grad(set_to_none=True)
            critic_optimizer.zero_grad(set_to_none=True)
            micro_batches = common.micro_batches(rollout, rows, args.system.micro_batch_size,
                                                 args.system.max_tokens_per_micro_batch, world)
            for i, mb in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                inputs = mb.inputs(rollout)
                with (common.gradient_sync(critic, enabled=last),
                      common.gradient_sync(policy, enabled=last or not train_actor)):
                    values = completion_values(critic, *inputs)
                    vf_loss, vf_stats = value_loss(values, mb(old_values), mb(returns), mb(mask), args.clip_value,
                                                   num_tokens)
                    loss = args.vf_coef * vf_loss
                    logged = {"losses/value_loss": vf_loss.item(), "losses/value_clipfrac": vf_stats["value_clipfrac"]}
                    if train_actor:
                        logprobs, entropy = common.completion_logprobs(policy, *inputs, args.task.temperature,
                                                                       with_entropy=True,
                                                                       entropy_grad=args.ent_coef > 0)
                        adv, engine_gap = mb(advantages), None
                        if rollout.logprobs is not None:  # vLLM sampled the tokens
                            adv, engine_gap = engine_correction(adv, mb(old_logprobs), mb(rollout.logprobs),
                                                                args.system.vllm_importance_cap)
                        pg_loss, pg_stats = policy_loss(logprobs, mb(old_logprobs), adv, mb(mask), args.clip_eps,
                                                        num_tokens)
                        entropy_bonus = token_mean(entropy, mb(mask), num_tokens)  # eq. 4
                        loss = pg_loss + loss - args.ent_coef * entropy_bonus
                        logged.update({"losses/policy_loss": pg_loss.item(), "losses/entropy": entropy_bonus.item(),
                                       "losses/surrogate": pg_stats["surrogate"],
                                       "losses/clipfrac": pg_stats["clipfrac"],
                                       "losses/approx_kl": pg_stats["approx_kl"], "charts/ratio": pg_stats["ratio"]})
                        if engine_gap is not None:
                            logged["charts/vllm_logprob_diff"] = token_mean(engine_gap, mb(mask), num_tokens).item()
                    loss.backward()
                for k, v in logged.items():
                    means[k] = means.get(k, 0.0) + v / (args.num_minibatches * args.update_epochs)
            critic_grad_norm = common.clip_grad_norm_(critic, args.max_grad_norm)
            grad_norm = common.clip_grad_norm_(policy, args.max_grad_norm) if train_actor else torch.zeros(())
            if torch.isfinite(grad_norm) and torch.isfinite(critic_grad_norm):
                critic_optimizer.step()
                if train_actor:
                    optimizer.step()
            else:  # a NaN/inf gradient never reaches the weights
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            critic_optimizer.zero_grad(set_to_none=True)
            for k, v in (("losses/grad_norm", grad_norm), ("losses/critic_grad_norm", critic_grad_norm)):
                means[k] = means.get(k, 0.0) + v.item() / (args.num_minibatches * args.update_epochs)
    policy.eval()
    critic.eval()
    return means, skipped


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------
def check_args(args: Args, world_size: int) -> None:
    bookkeeping.check_common_args(args, world_size)
    common.require(0 < args.clip_eps < 1, "clip_eps", args.clip_eps, "in (0, 1)")
    common.require(args.clip_value > 0, "clip_value", args.clip_value, "> 0")
    common.require(0 <= args.gamma <= 1, "gamma", args.gamma, "in [0, 1]")
    common.require(0 <= args.lam <= 1, "lam", args.lam, "in [0, 1]")
    common.require(args.critic_learning_rate > 0, "critic_learning_rate", args.critic_learning_rate, "> 0")
    common.require(0 <= args.critic_warmup_steps < args.num_steps, "critic_warmup_steps", args.critic_warmup_steps,
                   f"in [0, --num-steps) = [0, {args.num_steps})")
    common.require(args.vf_coef > 0, "vf_coef", args.vf_coef, "> 0")
    common.require(args.ent_coef >= 0, "ent_coef", args.ent_coef, ">= 0")


RewardFn = Callable[[common.Rollout, list], tuple[list, list, list]]
"""(rollout, tasks aligned with its rows) -> (reward, correct, well_formed), each one float per completion;
the default scores Countdown with countdown_reward.py."""


def train(args: Args, reward_fn: RewardFn | None = None, typed_flags: set[str] | None = None) -> dict:
    """`typed_flags`: the flags typed on the command line, which --resume checks against the run."""
    checkpoint, state = None, None
    if args.log.resume:  # the run's own configuration, its newest intact checkpoint and that checkpoint's state
        args, checkpoint, state = bookkeeping.resume_args(args, Args(), args.log.resume, SCRIPT, typed_flags)
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    if reward_fn is None:  # Countdown (countdown_reward.py)
        reward_fn = lambda rollout, tasks: common.countdown_rewards(  # noqa: E731
            rollout.texts, tasks, args.task.format_score, args.task.answer_score)
    world = common.setup_distributed(args.system.device)
    common.seed_everything(args.seed)
    # the run folder; a resumed run's is locked now
    run = bookkeeping.RunDir(args.log.runs_dir, args.exp_name, args.seed, checkpoint, world)

    # Data (checked before any model loads); each process takes its share of prompts_per_step
    train_tasks, test_tasks = common.load_countdown(
        args.dataset, args.task.test_size, args.seed, min_numbers=args.task.task_min_numbers,
        max_numbers=args.task.task_max_numbers, max_value=args.task.task_max_value, operators=args.task.task_operators)
    model_path = common.resolve_model(args.model)  # after the data: --model=bundled-warm may build the warm start
    eval_tasks = test_tasks[:args.task.eval_size]

    # Model, critic, reference model (only when the KL term is on), optimizers
    tokenizer = common.load_tokenizer(model_path)
    dtype = common.compute_dtype(args.system.compute_dtype, world.device)  # float32 weights, `dtype` matrix products
    policy = common.load_model(str(checkpoint or model_path), world.device, args.system.gradient_checkpointing,
                               dtype=dtype)
    critic = load_value_model(str(checkpoint / "critic") if checkpoint else model_path, world.device,
                                     args.system.gradient_checkpointing, dtype=dtype)
    ref_model = common.load_model(model_path, world.device, trainable=False, dtype=dtype) if args.beta > 0 else None
    # DDP, or FSDP2 with --fsdp
    policy = common.parallelize(policy, world, args.system.fsdp, args.system.fsdp_cpu_offload, dtype)
    ref_model = common.parallelize(ref_model, world, args.system.fsdp, dtype=dtype) if ref_model is not None else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    critic = common.parallelize(critic, world, args.system.fsdp, args.system.fsdp_cpu_offload, dtype)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=args.critic_learning_rate,
                                         weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    backend = common.make_backend(args.system.backend, policy, tokenizer, args.system, args.task, args.seed,
                                  str(checkpoint or model_path), world, train_tasks + test_tasks)
    run_dir = run.create()  # a new run's folder, made once every input has loaded
    logger = bookkeeping.RunLogger(run_dir, args, world, SCRIPT, args.log.track, args.log.wandb_project,
                                   state and state["step"], model_path)

    # What a checkpoint holds besides the weights; a resumed run restores it and continues as if never stopped
    sampler = common.PromptSampler(train_tasks, args.seed)
    update_rng = torch.Generator().manual_seed(args.seed)  # the update's minibatch order
    stateful = {"optimizer": common.OptimizerState(policy, optimizer),
                "critic_optimizer": common.OptimizerState(critic, critic_optimizer), "scheduler": scheduler,
                "sampler": sampler}
    start_step, skipped_steps, skipped_in_row = 1, 0, 0
    if state:
        start_step, skipped_steps = bookkeeping.restore_trainer_state(state, args.log.resume, update_rng, **stateful)
    stop = bookkeeping.StopRequest()  # Ctrl-C / SIGTERM: finish the step, save, exit

    bar, scalars = bookkeeping.ProgressBar(args.num_steps, world, initial=start_step - 1), {}
    if start_step == 1 and args.task.eval_size:  # step 0: the starting model, so that every curve begins there
        bar.phase("evaluating")
        logger.log(0, common.evaluate(backend, tokenizer, eval_tasks, args.task.max_new_tokens, world,
                                      args.task.prompt_template))
    for step in range(start_step, args.num_steps + 1):
        step_start = time.perf_counter()

        # ---- Rollout: completions for each prompt of this process's share ------------------------------
        tasks = sampler.next_batch(args.prompts_per_step, world)
        prompts = [common.make_prompt(tokenizer, t, args.task.prompt_template) for t in tasks]
        bar.phase("generating")
        with bookkeeping.Timer() as generation_time, bookkeeping.out_of_memory_hint("generation", args):
            rollout = backend.generate(prompts, args.group_size, args.task.max_new_tokens, args.task.temperature,
                                       args.task.top_p, seed=common.generation_seed(args.seed, step, world.rank))
        group_tasks = [t for t in tasks for _ in range(args.group_size)]

        # ---- Reward ------------------------------------------------------------------------------
        bar.phase("scoring")
        rewards, correct, well_formed = reward_fn(rollout, group_tasks)
        rewards = torch.tensor(rewards, dtype=torch.float32, device=world.device)

        bar.phase("updating")
        with bookkeeping.Timer() as update_time, bookkeeping.out_of_memory_hint("update", args):
            # ---- Old log-probs and values, reference log-probs -----------------------------------
            # pi_old's log-probs enter the KL penalty of eq. 8 as well as the ratio, so they are always
            # computed; V_old is the critic before this update (GAE and eq. 26's clipping).
            mask = rollout.completion_mask.to(torch.float32)
            old_logprobs = common.batched_logprobs(policy, rollout, args.system.micro_batch_size,
                                                   args.task.temperature)[0]
            old_values = batched_values(critic, rollout, args.system.micro_batch_size)
            ref_logprobs = old_logprobs if args.beta == 0 else common.batched_logprobs(
                ref_model, rollout, args.system.micro_batch_size, args.task.temperature)[0]

            # ---- Advantages: KL-penalised token rewards (eq. 8), GAE (eq. 21-22), whitening -------
            token_reward = token_rewards(rewards, old_logprobs, ref_logprobs, mask, args.beta)
            advantages, returns = gae_advantages(token_reward, old_values, mask, args.gamma, args.lam)
            if args.whiten_advantages:
                advantages = whiten(advantages, mask, world)

            # ---- Update (eq. 3: eq. 7 + eq. 26 - entropy) ----------------------------------------
            train_actor = step > args.critic_warmup_steps
            update_means, skipped = update_policy(policy, critic, optimizer, critic_optimizer, rollout, advantages,
                                                  returns, old_logprobs, old_values, args, update_rng, world,
                                                  train_actor)
            learning_rate = scheduler.get_last_lr()[0]  # the rate this step trained at, before the schedule moves on
            if train_actor:
                scheduler.step()
        if not (bookkeeping.weights_finite(policy, world) and bookkeeping.weights_finite(critic, world)):  # a huge step
            raise common.RunStopped(f"the weights are not finite after step {step}; the newest checkpoint in "
                                    f"{run_dir} holds the last good ones: lower --learning-rate")
        with bookkeeping.Timer() as sync_time:  # the generation engine samples from the new weights
            backend.sync_weights(policy)
        skipped_steps += skipped  # optimizer steps a NaN/inf gradient skipped: they never reached the weights
        skipped_in_row = skipped_in_row + 1 if skipped else 0
        if skipped:
            bar.write(bookkeeping.skipped_update_message(step, skipped, update_means))

        # ---- Logging: means over every process, per sequence or per completion token -------------------
        step_time = time.perf_counter() - step_start
        tokens = mask.bool()
        truncated = [r == "length" for r in rollout.finish_reasons]
        scalars = common.all_reduce_means({
            "charts/reward": rewards, "charts/accuracy": correct, "charts/format_rate": well_formed,
            "charts/response_length": rollout.completion_lengths, "charts/truncated_fraction": truncated,
            "charts/advantage_mean": advantages[tokens], "charts/value_mean": old_values[tokens],
            "charts/return_mean": returns[tokens]}, world)
        return_var = common.all_reduce_std(returns[tokens], world) ** 2
        error_var = common.all_reduce_std((returns - old_values)[tokens], world) ** 2
        kl_ref = {}  # beta = 0 loads no reference: its KL is not measured, not logged as 0
        if ref_model is not None:
            kl_ref["losses/kl_ref"] = kl_to_reference(old_logprobs, ref_logprobs, mask).item()
        scalars.update(common.average_over_processes({**update_means, **kl_ref}, world), **{
            "charts/advantage_std": common.all_reduce_std(advantages[tokens], world),
            "charts/explained_variance": 1 - error_var / return_var if return_var > 0 else float("nan"),
            "charts/learning_rate": learning_rate,
            "charts/tokens_per_second": scalars["charts/response_length"] * len(rewards) * world.world_size / step_time,
            "charts/skipped_steps": skipped_steps,
            "time/generation": generation_time.seconds, "time/update": update_time.seconds,
            "time/weight_sync": sync_time.seconds, "time/step": step_time})
        if args.task.eval_size and (args.log.eval_every and step % args.log.eval_every == 0 or step == args.num_steps):
            bar.phase("evaluating")
            scalars.update(common.evaluate(backend, tokenizer, eval_tasks, args.task.max_new_tokens, world,
                                           args.task.prompt_template))
        logger.log(step, scalars)
        if step % args.log.log_samples_every == 0 or step == 1:
            logger.log_samples(step, [prompts[i // args.group_size] for i in range(len(rewards))], rollout.texts,
                               rewards.tolist())
        bar.show(scalars)

        # ---- Checkpoint, then stop on a request or after --max-skipped-steps bad steps in a row ----------
        stopping = stop.requested(world)
        diverged = skipped_in_row >= args.system.max_skipped_steps
        final = step == args.num_steps or stopping or diverged
        if args.log.save_every and step % args.log.save_every == 0 or final:
            bookkeeping.save_checkpoint(policy, tokenizer, run_dir, step, world, critic=critic,
                                        keep=args.log.keep_checkpoints,
                                   final=final, state=bookkeeping.trainer_state(step, skipped_steps, update_rng,
                                                                                **stateful))
        if diverged:  # the skipped updates never reached the weights: the checkpoint is the last good state
            raise common.RunStopped(bookkeeping.divergence_message(skipped_in_row, args.system.max_skipped_steps,
                                                              f"{run_dir}/checkpoint-{step}"))
        if stopping:
            bar.write(f"stopped after step {step}; continue with: python {SCRIPT}.py --resume {run_dir}")
            break

    if step == args.num_steps:  # every step done (a stop request at the last one too): the weights alone, in final/
        bookkeeping.export_final(policy, tokenizer, run_dir, world,
                                 dtype if args.log.final_dtype == "compute" else torch.float32)
    bar.close()
    logger.close()
    backend.close()
    common.cleanup_distributed()
    return {"run_dir": run_dir, **scalars}


if __name__ == "__main__":
    common.run_command(lambda: train(tyro.cli(Args), typed_flags=bookkeeping.typed_flags(sys.argv[1:])))
