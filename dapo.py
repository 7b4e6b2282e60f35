"""Paper: "Comparative Analysis and Parametric Tuning of PPO, GRPO, and DAPO for LLM Reasoning Enhancement"
(arXiv:2512.07611, https://arxiv.org/abs/2512.07611).

DAPO on the Countdown game: paper section 2.3, equation 12 (objective), 10 (advantage).

DAPO is GRPO (grpo.py) with four changes: clip-higher (clip_low < clip_high), token-level loss
aggregation over the whole batch, dynamic sampling (drop groups whose answers are all right or all wrong
and sample more), and overlong reward shaping; no KL term by default. `diff grpo.py dapo.py` shows exactly those.

    python dapo.py                                             # bundled SmolLM2-135M, CPU, offline
    python dapo.py --model Qwen/Qwen2.5-1.5B-Instruct --no-dynamic-sampling   # the paper's best, GPU
    torchrun --nproc_per_node=N dapo.py ...                    # data-parallel on N processes

Read top to bottom: Args, the algorithm's functions (imported by tests), then the loop, cut into
rollout, reward, advantages, log-probs, update and logging. README.md maps every equation to its lines.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, NamedTuple

import torch
import tyro

import bookkeeping

import common

SCRIPT = Path(__file__).stem  # "dapo": names the run folder and its records, checked on --resume


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
    prompts_per_step: int = 16
    """prompts per step over all processes"""
    group_size: int = 2
    """G: completions sampled per prompt (eq. 9-10); the paper compares 2, 4 and 8"""
    learning_rate: float = 1e-5
    """AdamW learning rate (paper: 1e-6 for the 1.5B model; 1e-5 moves the 135M model within minutes)"""
    warmup_steps: int = 0
    """linear learning-rate warm-up, in training steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    clip_low: float = 0.2
    """epsilon_low of the clipped ratio (eq. 12): the ratio is kept above 1 - clip_low"""
    clip_high: float = 0.28
    """epsilon_high of the clipped ratio (eq. 12, clip-higher): the ratio is kept below 1 + clip_high"""
    beta: float = 0.0
    """KL coefficient; DAPO drops the KL term (0 skips the reference model). > 0 adds eq. 11's k3 penalty"""
    adv_eps: float = 1e-6
    """epsilon in the advantage's denominator (eq. 10)"""
    ent_coef: float = 0.0
    """entropy bonus (eq. 3's c2 * H): the paper's cheaper alternative to dynamic sampling for exploration"""
    update_epochs: int = 1
    """passes over each generation batch"""
    num_minibatches: int = 2
    """optimizer steps per pass, each on 1/N of the batch (verl's ppo_mini_batch_size = prompts-per-step / N).
    After the first, pi_theta has moved from pi_old and clipping acts; 1 epoch of 1 minibatch is on-policy:
    ratio 1, no clipping"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""

    # DAPO's techniques (clip-higher is clip_high above)
    dynamic_sampling: bool = True
    """drop groups whose completions all score the same and generate more prompts until the step is full
    (paper's best: off)"""
    dynamic_sampling_metric: Literal["accuracy", "reward"] = "accuracy"
    """what dynamic sampling compares: `accuracy` (DAPO, verl's `filter_groups.metric=acc`) drops groups all right or
    all wrong; `reward` drops only groups of equal shaped rewards (format score and overlong penalty count)"""
    max_generation_batches: int = 4
    """dynamic sampling: most generation batches per step; then train on the informative groups there are"""
    overlong_buffer: int = 0
    """soft overlong punishment: the last N tokens before max_new_tokens cost up to overlong_penalty (0: off)"""
    overlong_penalty: float = 1.0
    """soft overlong punishment: the reward lost by a completion of max_new_tokens tokens"""
    mask_truncated: bool = False
    """overlong filtering: completions cut at max_new_tokens get no gradient (left out of the loss)"""

    # Shared sections, the same in every script; their flags have no prefix (--max-new-tokens, --micro-batch-size)
    task: tyro.conf.OmitArgPrefixes[common.TaskArgs] = field(default_factory=common.TaskArgs)
    """generation, reward and data"""
    system: tyro.conf.OmitArgPrefixes[common.SystemArgs] = field(default_factory=common.SystemArgs)
    """devices, precision, memory, vLLM, sharding"""
    log: tyro.conf.OmitArgPrefixes[bookkeeping.LogArgs] = field(default_factory=bookkeeping.LogArgs)
    """logging, checkpoints, resume"""


# ----------------------------------------------------------------------------------------------------
# DAPO's mathematics
# ----------------------------------------------------------------------------------------------------
LOG_RATIO_LIMIT = 20.0
"""log-ratios are clamped to +-this before exp: e^20 is large but finite, e^95 * 0 would be NaN"""
KL_LIMIT = 10.0
"""the k3 KL estimate of one token is clamped to at most this (verl's bound)"""


def equal_reward_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """One bool per group of `group_size` contiguous rewards: are they all exactly equal? Such a group
    carries no learning signal (eq. 10 is 0/0); a float std is no test, its round-off is not 0."""
    grouped = rewards.view(-1, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Eq. 10: A_i = (r_i - mean(r)) / (std(r) + eps) within each group of `group_size` contiguous rewards.

    std is the population standard deviation (divide by G), as in the worked example of the three algorithms
    (rewards 2, 10, 3: std 3.559, tests/test_grpo.py).
    Computed in float32 whatever the rewards' dtype; a group whose rewards are all equal gets exactly
    0 (in float32, [0.1] * 8 would otherwise give -0.0075 from the round-off of its mean).
    """
    grouped = rewards.float().view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, unbiased=False)
    advantages = (grouped - mean) / (std + eps)
    uniform = equal_reward_groups(rewards, group_size).unsqueeze(1)
    return torch.where(uniform, torch.zeros_like(advantages), advantages).view(-1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Eq. 11, per token: pi_ref/pi - log(pi_ref/pi) - 1 >= 0 (Schulman's k3 estimator).

    As verl does, the log-ratio is clamped to +-20 before exp (a padded position may hold anything)
    and the estimate to at most 10 (one token's outlier cannot dominate the batch's KL)."""
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(max=KL_LIMIT)


def token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None) -> torch.Tensor:
    """Token-level aggregation of eq. 12: the sum over every valid token divided by the number of tokens
    (1 / sum_i |o_i|), so a long sequence weighs more than a short one. `num_tokens` is the count of the
    whole batch when this is one micro-batch or one process's share of it; default: this mask's count."""
    if num_tokens is None:
        num_tokens = mask.sum().clamp(min=1)
    return torch.where(mask.bool(), values, 0.0).sum() / num_tokens


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_low: float, clip_high: float,
                num_tokens: float | None = None):
    """Minus eq. 12's clipped surrogate with clip-higher, token-level aggregation.

    logprobs, old_logprobs, mask: (B, T); advantages: (B, T) or (B, 1), a sequence's advantage on each of its
    tokens (eq. 9's A_i for every t), weighted per token by engine_correction under vLLM.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
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


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - buffer tokens, then falling linearly to
    -penalty at max_new_tokens (longer completions cannot be generated)."""
    return -penalty * ((lengths - (max_new_tokens - buffer)).clamp(min=0) / buffer).clamp(max=1.0)


class GenerationBatch(NamedTuple):
    """One call of the generation backend and its rewards (dynamic sampling may make several per step)."""
    prompts: list[str]
    rollout: common.Rollout
    rewards: torch.Tensor
    correct: list[float]
    well_formed: list[float]
    seconds: float


def dynamic_sampling(batches: list[GenerationBatch], num_groups: int, group_size: int,
                     metric: str) -> list[tuple[int, int, bool]]:
    """DAPO's dynamic sampling (its Algorithm 1): of this step's generation batches, keep the groups whose
    filter metric (`accuracy`, as DAPO and verl's recipe filter, or the shaped `reward`) is not the same
    for every completion, at most num_groups.

    Returns num_groups (generation batch, group, in_loss) triples: the informative groups, then, while
    there are too few, uninformative ones with in_loss False that only keep the batch shape the same on
    every process (they are masked out of the loss).
    """
    informative, uninformative = [], []
    for b, batch in enumerate(batches):
        values = torch.tensor(batch.correct) if metric == "accuracy" else batch.rewards
        for group, all_equal in enumerate(equal_reward_groups(values, group_size).tolist()):
            (uninformative if all_equal else informative).append((b, group))
    kept = [(b, g, True) for b, g in informative[:num_groups]]
    return kept + [(b, g, False) for b, g in uninformative[:num_groups - len(kept)]]


def training_batch(batches: list[GenerationBatch], groups: list[tuple[int, int, bool]], group_size: int,
                   pad_token_id: int) -> tuple[common.Rollout, torch.Tensor, torch.Tensor]:
    """The selected groups as one rollout, their rewards, and which completions are in the loss."""
    rows = lambda g: list(range(g * group_size, (g + 1) * group_size))  # noqa: E731
    rollout = common.concat_rollouts([batches[b].rollout.select(rows(g)) for b, g, _ in groups], pad_token_id)
    rewards = torch.cat([batches[b].rewards[rows(g)] for b, g, _ in groups])
    kept = torch.tensor([keep for _, _, keep in groups for _ in range(group_size)], device=rewards.device)
    return rollout, rewards, kept


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
def update_policy(policy, optimizer, rollout: common.Rollout, advantages, old_logprobs, ref_model,
                  args: Args, update_rng: torch.Generator, world: common.Dist, loss_mask=None) -> tuple[dict, int]:
    """Minimise -eq. 12 (clipped surrogate, token-level; - beta * k3 KL, - ent_coef * entropy) over the
    rollout. Returns the update's means under their logged names, and how many optimizer steps a non-finite
    gradient skipped. `loss_mask` (default: the completion mask) leaves tokens out of the loss.

    `old_logprobs`: pi_old's, (B, T); on-policy (one epoch of one minibatch) pi_old is the policy itself,
    so the update takes them from its own forward pass, detached, and `old_logprobs` is not needed (None).

    Minibatches come from one permutation of every process's rows, and each process trains on an equal
    slice of each. Eq. 12 divides by the number of tokens of the whole minibatch: every micro-batch divides
    its token sum by that count (over the number of processes, which DDP's gradient average divides out),
    so the update does not depend on how the batch is split over micro-batches and processes.
    """
    # every process's rows: the minibatches are slices of one permutation of them all
    rollout, advantages, old_logprobs, loss_mask = common.all_gather_rows(world, rollout, advantages, old_logprobs,
                                                                          loss_mask)
    mask = (rollout.completion_mask if loss_mask is None else loss_mask).to(torch.float32)
    batch_size = len(advantages)
    on_policy = args.update_epochs == 1 and args.num_minibatches == 1
    means: dict[str, float] = {}
    skipped = 0
    policy.train()
    for _ in range(args.update_epochs):
        for minibatch in torch.randperm(batch_size, generator=update_rng).chunk(args.num_minibatches):
            rows = minibatch.chunk(world.world_size)[world.rank]  # this process's slice of the minibatch
            num_tokens = mask[minibatch].sum().item() / world.world_size  # DDP averages over processes
            if num_tokens == 0:  # every token masked out (dynamic sampling found nothing, or all truncated)
                continue
            optimizer.zero_grad(set_to_none=True)
            micro_batches = common.micro_batches(rollout, rows, args.system.micro_batch_size,
                                                 args.system.max_tokens_per_micro_batch, world)
            for i, mb in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                with common.gradient_sync(policy, enabled=last):
                    logprobs, entropy = common.completion_logprobs(policy, *mb.inputs(rollout), args.task.temperature,
                                                                   with_entropy=True, entropy_grad=args.ent_coef > 0)
                    old = logprobs.detach() if on_policy else mb(old_logprobs)
                    adv, engine_gap = mb(advantages).unsqueeze(-1), None  # (b, 1): on every token
                    if rollout.logprobs is not None:  # vLLM sampled the tokens
                        adv, engine_gap = engine_correction(adv, old, mb(rollout.logprobs),
                                                            args.system.vllm_importance_cap)
                    pg_loss, stats = policy_loss(logprobs, old, adv, mb(mask), args.clip_low, args.clip_high,
                                                 num_tokens)
                    if ref_model is not None:  # on this very micro-batch: while pi_theta = pi_ref, exactly equal
                        with torch.no_grad():
                            ref, _ = common.completion_logprobs(common.unwrap(ref_model), *mb.inputs(rollout),
                                                                args.task.temperature)
                        kl = token_mean(kl_k3(logprobs, ref), mb(mask), num_tokens)
                    else:
                        kl = torch.zeros((), device=logprobs.device)
                    entropy_bonus = token_mean(entropy, mb(mask), num_tokens)  # eq. 3's S term
                    loss = pg_loss + args.beta * kl - args.ent_coef * entropy_bonus
                    loss.backward()
                logged = {"losses/policy_loss": pg_loss.item(),
                          "losses/entropy": entropy_bonus.item(),
                          "losses/surrogate": stats["surrogate"], "losses/clipfrac": stats["clipfrac"],
                          "losses/approx_kl": stats["approx_kl"], "charts/ratio": stats["ratio"]}
                if ref_model is not None:  # beta = 0 loads no reference: its KL is not measured, not logged as 0
                    logged["losses/kl_ref"] = kl.item()
                if engine_gap is not None:
                    logged["charts/vllm_logprob_diff"] = token_mean(engine_gap, mb(mask), num_tokens).item()
                for k, v in logged.items():
                    means[k] = means.get(k, 0.0) + v / (args.num_minibatches * args.update_epochs)
            grad_norm = common.clip_grad_norm_(policy, args.max_grad_norm)
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:  # a NaN/inf gradient never reaches the weights
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
            means["losses/grad_norm"] = means.get("losses/grad_norm", 0.0) + grad_norm.item() / (
                args.num_minibatches * args.update_epochs)
    policy.eval()
    return means, skipped


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------
def check_args(args: Args, world_size: int) -> None:
    bookkeeping.check_common_args(args, world_size)
    common.require(args.group_size >= 2, "group_size", args.group_size, ">= 2 (eq. 10 compares completions)")
    common.require(0 < args.clip_low < 1, "clip_low", args.clip_low, "in (0, 1)")
    common.require(args.clip_high > 0, "clip_high", args.clip_high, "> 0 (DAPO: 0.28)")
    common.require(args.max_generation_batches >= 1, "max_generation_batches", args.max_generation_batches,
                   "a positive integer")
    common.require(args.ent_coef >= 0, "ent_coef", args.ent_coef, ">= 0")
    common.require(0 <= args.overlong_buffer < args.task.max_new_tokens, "overlong_buffer", args.overlong_buffer,
                   f"in [0, --max-new-tokens) = [0, {args.task.max_new_tokens})")
    common.require(args.overlong_penalty >= 0, "overlong_penalty", args.overlong_penalty, ">= 0")
    common.require(args.adv_eps > 0, "adv_eps", args.adv_eps, "> 0")


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

    # Model, reference model (only when the KL term is on), optimizer
    tokenizer = common.load_tokenizer(model_path)
    dtype = common.compute_dtype(args.system.compute_dtype, world.device)  # float32 weights, `dtype` matrix products
    policy = common.load_model(str(checkpoint or model_path), world.device, args.system.gradient_checkpointing,
                               dtype=dtype)
    ref_model = common.load_model(model_path, world.device, trainable=False, dtype=dtype) if args.beta > 0 else None
    # DDP, or FSDP2 with --fsdp
    policy = common.parallelize(policy, world, args.system.fsdp, args.system.fsdp_cpu_offload, dtype)
    ref_model = common.parallelize(ref_model, world, args.system.fsdp, dtype=dtype) if ref_model is not None else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    backend = common.make_backend(args.system.backend, policy, tokenizer, args.system, args.task, args.seed,
                                  str(checkpoint or model_path), world, train_tasks + test_tasks)
    run_dir = run.create()  # a new run's folder, made once every input has loaded
    logger = bookkeeping.RunLogger(run_dir, args, world, SCRIPT, args.log.track, args.log.wandb_project,
                                   state and state["step"], model_path)

    # What a checkpoint holds besides the weights; a resumed run restores it and continues as if never stopped
    sampler = common.PromptSampler(train_tasks, args.seed)
    update_rng = torch.Generator().manual_seed(args.seed)  # the update's minibatch order
    stateful = {"optimizer": common.OptimizerState(policy, optimizer), "scheduler": scheduler, "sampler": sampler}
    start_step, skipped_steps, skipped_in_row = 1, 0, 0
    if state:
        start_step, skipped_steps = bookkeeping.restore_trainer_state(state, args.log.resume, update_rng, **stateful)
    stop = bookkeeping.StopRequest()  # Ctrl-C / SIGTERM: finish the step, save, exit

    bar, scalars = bookkeeping.ProgressBar(args.num_steps, world, initial=start_step - 1), {}
    if start_step == 1 and args.task.eval_size:  # step 0: the starting model, so that every curve begins there
        bar.phase("evaluating")
        logger.log(0, common.evaluate(backend, tokenizer, eval_tasks, args.task.max_new_tokens, world,
                                      args.task.prompt_template))
    local_prompts = args.prompts_per_step // world.world_size
    for step in range(start_step, args.num_steps + 1):
        step_start = time.perf_counter()
        batches = []  # this step's generation batches: more than one only with dynamic sampling
        for batch in range(args.max_generation_batches):

            # ---- Rollout: G completions for each prompt of this process's share ----------------------
            tasks = sampler.next_batch(args.prompts_per_step, world)
            prompts = [common.make_prompt(tokenizer, t, args.task.prompt_template) for t in tasks]
            bar.phase("generating")
            seed = common.generation_seed(args.seed, step, world.rank, batch)
            with bookkeeping.Timer() as generation_time, bookkeeping.out_of_memory_hint("generation", args):
                generated = backend.generate(prompts, args.group_size, args.task.max_new_tokens, args.task.temperature,
                                             args.task.top_p, seed=seed)
            group_tasks = [t for t in tasks for _ in range(args.group_size)]

            # ---- Reward, with the soft overlong punishment -------------------------------------------
            bar.phase("scoring")
            scores, correct, well_formed = reward_fn(generated, group_tasks)
            scores = torch.tensor(scores, dtype=torch.float32, device=world.device)
            if args.overlong_buffer > 0:
                scores += overlong_penalty(generated.completion_lengths.to(scores), args.task.max_new_tokens,
                                           args.overlong_buffer, args.overlong_penalty)

            # ---- Dynamic sampling: informative groups only; sample more prompts until the step is full
            batches.append(GenerationBatch(prompts, generated, scores, correct, well_formed, generation_time.seconds))
            groups = (dynamic_sampling(batches, local_prompts, args.group_size, args.dynamic_sampling_metric)
                      if args.dynamic_sampling else [(0, g, True) for g in range(local_prompts)])
            missing = common.all_reduce_sum([sum(not in_loss for _, _, in_loss in groups)], world)[0]
            if not missing:  # every process agrees: `missing` is summed over them
                break
        rollout, rewards, kept = training_batch(batches, groups, args.group_size, tokenizer.pad_token_id)
        in_loss = kept.clone()
        if args.mask_truncated:  # overlong filtering
            in_loss &= torch.tensor([r == "stop" for r in rollout.finish_reasons], device=world.device)
        loss_mask = rollout.completion_mask * in_loss.unsqueeze(-1)

        # ---- Advantages (eq. 10) -----------------------------------------------------------------
        advantages = group_advantages(rewards, args.group_size, args.adv_eps)

        bar.phase("updating")
        with bookkeeping.Timer() as update_time, bookkeeping.out_of_memory_hint("update", args):
            # ---- Old log-probs (the reference's are taken in the update, micro-batch by micro-batch) ----
            # One epoch of one minibatch is on-policy: pi_old is the policy itself, so its log-probs are
            # the detached current ones and need no extra forward pass.
            on_policy = args.update_epochs == 1 and args.num_minibatches == 1
            old_logprobs = None if on_policy else common.batched_logprobs(
                policy, rollout, args.system.micro_batch_size, args.task.temperature)[0]

            # ---- Update (eq. 12) -----------------------------------------------------------------
            update_means, skipped = update_policy(policy, optimizer, rollout, advantages, old_logprobs, ref_model,
                                                  args, update_rng, world, loss_mask)
            learning_rate = scheduler.get_last_lr()[0]  # the rate this step trained at, before the schedule moves on
            scheduler.step()
        if not bookkeeping.weights_finite(policy, world):  # a finite gradient times a huge step
            raise common.RunStopped(f"the weights are not finite after step {step}; the newest checkpoint in "
                                    f"{run_dir} holds the last good ones: lower --learning-rate")
        with bookkeeping.Timer() as sync_time:  # the generation engine samples from the new weights
            backend.sync_weights(policy)
        skipped_steps += skipped  # optimizer steps a NaN/inf gradient skipped: they never reached the weights
        skipped_in_row = skipped_in_row + 1 if skipped else 0
        if skipped:
            bar.write(bookkeeping.skipped_update_message(step, skipped, update_means))

        # ---- Logging: means over every process; rewards of all generated, advantages of what trained ----
        step_time = time.perf_counter() - step_start
        generated_rewards = torch.cat([b.rewards for b in batches])
        truncated = [r == "length" for b in batches for r in b.rollout.finish_reasons]
        scalars = common.all_reduce_means({
            "charts/reward": generated_rewards, "charts/accuracy": [c for b in batches for c in b.correct],
            "charts/format_rate": [w for b in batches for w in b.well_formed],
            "charts/response_length": torch.cat([b.rollout.completion_lengths for b in batches]),
            "charts/truncated_fraction": truncated,
            "charts/zero_std_fraction": torch.cat([equal_reward_groups(b.rewards, args.group_size) for b in batches]),
            "charts/advantage_mean": advantages[kept]}, world)
        counts = common.all_reduce_sums({"trained": kept.sum().item(), "generated": len(generated_rewards)}, world)
        scalars.update(common.average_over_processes(update_means, world), **{
            "charts/advantage_std": common.all_reduce_std(advantages[kept], world),
            "charts/generation_batches": len(batches),
            "charts/dropped_fraction": 1 - counts["trained"] / counts["generated"],  # generated, not trained on
            "charts/learning_rate": learning_rate,
            "charts/tokens_per_second": scalars["charts/response_length"] * counts["generated"] / step_time,
            "charts/skipped_steps": skipped_steps,
            "time/generation": sum(b.seconds for b in batches),
            **common.average_over_processes({"time/regeneration": sum(b.seconds for b in batches[1:])}, world),
            "time/update": update_time.seconds, "time/weight_sync": sync_time.seconds, "time/step": step_time})
        if counts["trained"] < args.prompts_per_step * args.group_size:
            bar.write(f"step {step}: dynamic sampling stopped at --max-generation-batches="
                      f"{args.max_generation_batches}; training on {int(counts['trained']) // args.group_size} "
                      f"informative groups, not {args.prompts_per_step}")
        if args.task.eval_size and (args.log.eval_every and step % args.log.eval_every == 0 or step == args.num_steps):
            bar.phase("evaluating")
            scalars.update(common.evaluate(backend, tokenizer, eval_tasks, args.task.max_new_tokens, world,
                                           args.task.prompt_template))
        logger.log(step, scalars)
        if step % args.log.log_samples_every == 0 or step == 1:
            last = batches[-1]
            logger.log_samples(step, [last.prompts[i // args.group_size] for i in range(len(last.rewards))],
                               last.rollout.texts, last.rewards.tolist())
        bar.show(scalars)

        # ---- Checkpoint, then stop on a request or after --max-skipped-steps bad steps in a row ----------
        stopping = stop.requested(world)
        diverged = skipped_in_row >= args.system.max_skipped_steps
        final = step == args.num_steps or stopping or diverged
        if args.log.save_every and step % args.log.save_every == 0 or final:
            bookkeeping.save_checkpoint(policy, tokenizer, run_dir, step, world, keep=args.log.keep_checkpoints,
                                        final=final,
                                   state=bookkeeping.trainer_state(step, skipped_steps, update_rng, **stateful))
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
