"""Samples come from pi_theta: a checkpoint whose generation_config.json asks for a repetition penalty,
top-k and n-gram blocking changes neither HF sampling nor greedy evaluation (vLLM: tests/vllm_worker.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import common

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def opinionated_model_dir(tmp_path_factory, peaked_model_dir) -> str:
    """The peaked tiny model (it repeats tokens, so a repetition penalty bites) with a generation_config
    that tries to change sampling, as Qwen2.5-Instruct's does (repetition_penalty 1.05-1.1, top_k, top_p)."""
    path = tmp_path_factory.mktemp("opinionated")
    AutoModelForCausalLM.from_pretrained(peaked_model_dir).save_pretrained(path)
    AutoTokenizer.from_pretrained(peaked_model_dir).save_pretrained(path)
    GenerationConfig(repetition_penalty=1.3, top_k=5, top_p=0.8, no_repeat_ngram_size=2, temperature=0.3,
                     do_sample=True).save_pretrained(path)
    return str(path)


def prompts(n=2):
    return [f"Using the numbers [{i}, 7, 9], create an equation that equals {i + 16}." for i in range(n)]


def test_sampled_tokens_have_the_policys_logprobs(opinionated_model_dir):
    model = common.load_model(opinionated_model_dir, torch.device("cpu"))
    assert model.generation_config.repetition_penalty == 1.3  # the checkpoint's settings are there to ignore
    backend = common.HFBackend(model, common.load_tokenizer(opinionated_model_dir))
    rollout = backend.generate(prompts(), 4, 24, TEMPERATURE, seed=0, return_logprobs=True)
    policy, _ = common.completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                           rollout.completion_mask, TEMPERATURE)
    mask = rollout.completion_mask.bool()
    assert mask.sum() > 40
    # the sampler's KV-cached decoding and the log-prob pass run other float32 kernels on this model's large
    # logits (its norm is scaled by 9): 1e-5 apart on average (1.4e-5 in one CI run), 2e-5 at most, against
    # > 0.05 below
    gap = (rollout.logprobs[mask] - policy[mask].detach()).abs()
    assert gap.mean() < 5e-5 and gap.max() < 1e-4
    assert model.generation_config.repetition_penalty == 1.3  # put back for save_pretrained


def test_the_checkpoints_settings_would_have_changed_the_samples(opinionated_model_dir):
    """What the test above guards against: generate with the checkpoint's own defaults merged in."""
    model = common.load_model(opinionated_model_dir, torch.device("cpu"))
    tok = common.load_tokenizer(opinionated_model_dir)
    ids, mask = common.encode_prompts(tok, prompts(), 4, model.device)
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, temperature=TEMPERATURE,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
    completion = out.sequences[:, ids.shape[1]:]
    sampler = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    policy, _ = common.completion_logprobs(model, ids, mask, completion, torch.ones_like(completion), TEMPERATURE)
    finite = torch.isfinite(sampler)
    assert (sampler[finite] - policy[finite]).abs().mean() > 0.05


def test_greedy_evaluation_decodes_the_argmax_of_the_models_own_logits(opinionated_model_dir):
    model = common.load_model(opinionated_model_dir, torch.device("cpu"))
    backend = common.HFBackend(model, common.load_tokenizer(opinionated_model_dir))
    rollout = backend.generate(prompts(3), 1, 24, 0.0)
    input_ids, attention_mask, position_ids = common.model_inputs(
        rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    T = rollout.completion_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    argmax = logits[:, -(T + 1):-1].argmax(-1)
    mask = rollout.completion_mask.bool()
    assert T == 24 and torch.equal(argmax[mask], rollout.completion_ids[mask])
    # the peaked model repeats itself, which no_repeat_ngram_size=2 would have forbidden
    repeated = [len(set(zip(ids[:-1], ids[1:]))) < len(ids) - 1 for ids in rollout.completion_ids.tolist()]
    assert any(repeated)
