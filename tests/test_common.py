"""common.py: data, prompt, masks, log-probs against generation, entropy, errors."""

import json
import math
import random
import shutil
import subprocess
import sys

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutput

import bookkeeping

import common
import countdown_reward
from conftest import ROOT, subprocess_env, synthetic_rollout


def test_generated_tasks_are_solvable_deterministic_and_held_out():
    tasks = common.generate_tasks(300, seed=3)
    assert tasks == common.generate_tasks(300, seed=3)
    for t in tasks:
        assert 3 <= len(t["nums"]) <= 4 and all(1 <= n <= 99 for n in t["nums"])
        assert countdown_reward.compute_score(f"</think><answer>{t['solution']}</answer>", t["nums"],
                                              t["target"]) == 1.0
    easy = common.generate_tasks(50, seed=0, min_numbers=2, max_numbers=2, max_value=10, operators="+")
    assert all(t["target"] == sum(t["nums"]) for t in easy)
    train, test = common.load_countdown("generated", test_size=64, seed=5, train_size=2000)
    _, test_other_seed = common.load_countdown("generated", test_size=64, seed=6, train_size=10)
    assert test == test_other_seed  # the held-out split does not move with the seed
    held_out = {(tuple(sorted(t["nums"])), t["target"]) for t in test}
    assert not any((tuple(sorted(t["nums"])), t["target"]) in held_out for t in train)


@pytest.mark.parametrize("settings", [(2, 2, 6, "+-*/"), (2, 3, 5, "-/"), (3, 3, 4, "+-*")])
def test_reachable_task_keys_are_the_keys_the_generator_draws(settings):
    rng, drawn = random.Random(0), set()
    for _ in range(30000):
        task = common.generate_task(rng, *settings)
        drawn.add(common.task_key(task))
    assert drawn == common.reachable_task_keys(*settings)  # none missing (an early stop), none extra (no stop)
    # settings generate_task does not take are not enumerated (no operators would walk every order for nothing)
    assert common.reachable_task_keys(3, 4, 99, "") is common.reachable_task_keys(3, 2, 9, "+") is None


def test_the_draws_stop_once_every_task_is_drawn_and_give_the_same_tasks(monkeypatch):
    """The CPU default rung (two numbers up to 20, `+ *`) allows 419 tasks: load_countdown's 20,000
    training tasks would take all 401,000 draws; they stop once the 291 left after the 128 held out are
    drawn, with the very tasks the whole budget gives."""
    cpu_rung = dict(min_numbers=2, max_numbers=2, max_value=20, operators="+*")
    draws = []
    generate_task = common.generate_task
    monkeypatch.setattr(common, "generate_task", lambda *a, **k: draws.append(1) or generate_task(*a, **k))
    train, test = common.load_countdown("generated", test_size=128, seed=3, **cpu_rung)
    assert len(train) + len(test) == len(common.reachable_task_keys(2, 2, 20, "+*")) == 419
    assert len(draws) < 20000  # of a budget of 20 x 128 + 1000 for the test split and 401,000 for training
    monkeypatch.setattr(common, "reachable_task_keys", lambda *a, **k: None)  # every draw of the budget
    assert common.load_countdown("generated", test_size=128, seed=3, **cpu_rung) == (train, test)


def test_local_files_and_their_errors(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps({"nums": [i, 2, 3], "target": i + 5}) for i in range(1, 11)))
    train, test = common.load_countdown(str(path), test_size=3, seed=0)
    assert len(train) == 7 and test[-1] == {"nums": [10, 2, 3], "target": 15}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"numbers": [1, 2], "target": 3}))
    with pytest.raises(common.ConfigError, match="--dataset=.*lacks the 'nums' and 'target' columns"):
        common.load_countdown(str(bad), test_size=1, seed=0)
    with pytest.raises(common.ConfigError, match="--dataset=.*does not exist"):
        common.load_countdown(str(tmp_path / "missing.jsonl"), test_size=1, seed=0)
    with pytest.raises(common.ConfigError, match="--test-size=10 .*only 10 rows"):
        common.load_countdown(str(path), test_size=10, seed=0)


def test_prompt_sampler_shards_the_same_global_batch():
    tasks = [{"nums": [i], "target": i} for i in range(10)]
    one = common.PromptSampler(tasks, seed=1)
    two = [common.PromptSampler(tasks, seed=1) for _ in range(2)]
    for _ in range(4):  # crosses an epoch boundary
        whole = one.next_batch(4, common.Dist())
        halves = [s.next_batch(4, common.Dist(rank=r, world_size=2)) for r, s in enumerate(two)]
        assert halves[0] + halves[1] == whole


def test_prompt_uses_chat_template_and_prefill(tokenizer):
    task = {"nums": [3, 5, 7], "target": 22}
    chat = common.make_prompt(tokenizer, task)
    assert chat.startswith("<|im_start|>system")
    assert "Using the numbers [3, 5, 7], create an equation that equals 22" in chat
    assert chat.endswith("<|im_start|>assistant\nLet me solve this step by step.\n<think>")
    base = common.make_prompt(tokenizer, task, "base")
    assert base.startswith("A conversation between User and Assistant") and base.endswith("<think>")


@pytest.mark.parametrize("template", ["auto", "base"])
def test_longest_prompt_is_the_longest_of_every_task(tokenizer, template):
    # vLLM's max_model_len is sized by it: a data file may hold more or longer numbers than the generated rungs.
    # Many tasks of mixed size, the longest not last and its numbers not the largest values
    rng = random.Random(0)
    tasks = [{"nums": [rng.randint(1, 10 ** rng.randint(1, 6)) for _ in range(rng.randint(2, 9))],
              "target": rng.randint(1, 10 ** rng.randint(1, 7))} for _ in range(400)]
    count = lambda t: len(tokenizer(common.make_prompt(tokenizer, t, template), add_special_tokens=False).input_ids)
    every = max(count(t) for t in tasks)
    floor = count({"nums": [99999] * 6, "target": 99999})
    assert every > floor  # the case that matters: these tasks outgrow the old fixed bound
    assert common.longest_prompt_tokens(tokenizer, tasks, template) == every
    small = [{"nums": [3, 5], "target": 8}]
    assert common.longest_prompt_tokens(tokenizer, small, template) == floor  # never below the old bound


def test_completion_mask_stops_after_first_stop_token():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 2, 2, 2]])
    mask, reasons = common.completion_mask_from_ids(ids, [2])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert reasons == ["stop", "length", "stop"]


def test_logprobs_ignore_left_padding(tiny_model_dir):
    model = common.load_model(tiny_model_dir, torch.device("cpu"))
    r = synthetic_rollout(batch_size=3)
    batched, _ = common.batched_logprobs(model, r, micro_batch_size=3)
    for i in range(3):  # each row alone, padding stripped, gives the same log-probs
        keep = r.prompt_mask[i] == 1
        alone = common.Rollout(r.prompt_ids[i:i + 1, keep], r.prompt_mask[i:i + 1, keep], r.completion_ids[i:i + 1],
                               r.completion_mask[i:i + 1], [""], ["stop"])
        single, _ = common.batched_logprobs(model, alone, 1)
        m = r.completion_mask[i] == 1
        torch.testing.assert_close(single[0][m], batched[i][m], atol=1e-4, rtol=1e-4)


def test_logprobs_match_what_generate_sampled_from(tiny_model_dir, tokenizer):
    """The trainer's log-probs are those of the distribution generate sampled from (temperature too)."""
    model = common.load_model(tiny_model_dir, torch.device("cpu"))
    prompts = ["Hello there", "A much longer prompt than the first one, to force padding"]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(**enc, do_sample=True, temperature=0.7, top_k=0, max_new_tokens=6,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    completion = out.sequences[:, enc.input_ids.shape[1]:]
    expected = torch.stack([torch.log_softmax(l.float() / 0.7, -1) for l in out.logits], 1)
    expected = expected.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    mask, _ = common.completion_mask_from_ids(completion, [tokenizer.eos_token_id])
    got, _ = common.completion_logprobs(model, enc.input_ids, enc.attention_mask, completion, mask, temperature=0.7)
    torch.testing.assert_close(got[mask == 1], expected[mask == 1], atol=1e-4, rtol=1e-4)


class GivenLogits(torch.nn.Module):
    """A 'language model' whose next-token logits at the completion's positions are the given (B, T, V) tensor."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, logits_to_keep=0, **_):
        B, T, V = self.logits.shape
        assert logits_to_keep == T + 1  # the positions that predict the completion's tokens, and one more
        return CausalLMOutput(logits=torch.cat([self.logits, torch.zeros(B, 1, V)], 1))


def test_entropy_of_a_uniform_and_a_known_distribution(tiny_model_dir):
    model = common.load_model(tiny_model_dir, torch.device("cpu"))
    with torch.no_grad():
        model.model.norm.weight.zero_()  # zero hidden state -> all logits 0 -> uniform over the vocabulary
    r = synthetic_rollout(batch_size=2)
    _, entropy = common.batched_logprobs(model, r, 2, with_entropy=True)
    valid = entropy[r.completion_mask.bool()]  # padding positions are not computed (zero)
    assert valid.tolist() == pytest.approx([math.log(model.config.vocab_size)] * valid.numel(), abs=1e-4)

    def entropy_of(logits, temperature=1.0):
        B, T, _ = logits.shape
        ids = torch.zeros(B, T, dtype=torch.long)
        _, entropy = common.completion_logprobs(GivenLogits(logits), ids, torch.ones_like(ids), ids,
                                                torch.ones_like(ids), temperature, with_entropy=True)
        return entropy

    # p = (1/4, 3/4): H = -(1/4 ln 1/4 + 3/4 ln 3/4)
    known = entropy_of(torch.tensor([0.0, math.log(3.0)]).expand(1, 2, 2))
    assert known[0].tolist() == pytest.approx([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))] * 2, abs=1e-6)
    # any logits, at a sampling temperature: the entropy of the distribution sampled from, p = softmax(l / T)
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)) * 4
    expected = torch.distributions.Categorical(logits=logits / 0.7).entropy()
    torch.testing.assert_close(entropy_of(logits, 0.7), expected, atol=1e-5, rtol=1e-5)


def test_hf_backend_greedy_is_deterministic_and_masks_after_stop(tiny_model_dir, tokenizer):
    model = common.load_model(tiny_model_dir, torch.device("cpu"))
    backend = common.HFBackend(model, tokenizer)
    a = backend.generate(["one", "two three"], 2, 5, temperature=0.0)
    b = backend.generate(["one", "two three"], 2, 5, temperature=0.0)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    assert a.prompt_ids.shape[0] == 4 and torch.equal(a.completion_ids[0], a.completion_ids[1])  # groups contiguous
    s1 = backend.generate(["one"], 4, 5, temperature=1.0, seed=1)
    s2 = backend.generate(["one"], 4, 5, temperature=1.0, seed=1)
    assert torch.equal(s1.completion_ids, s2.completion_ids)
    assert all(reason in ("stop", "length") for reason in a.finish_reasons)


def test_bad_model_name_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(common.ConfigError, match="--model=.*no config.json"):
        common.resolve_model(str(tmp_path / "empty"))


def test_a_hub_id_loads_from_the_local_hf_cache_offline(tiny_model_dir, tmp_path):
    """No hub access here: a hub id must resolve to its complete cached snapshot, and an incomplete one
    (weights missing) must be a one-line error, not a half-loaded model."""
    def resolve(repo_id):
        env = {**subprocess_env(), "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
        code = f"import common; print(common.resolve_model({repo_id!r}))"
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)

    for name, weights in (("complete", True), ("partial", False)):
        repo = tmp_path / "hub" / f"models--org--{name}"
        shutil.copytree(tiny_model_dir, repo / "snapshots" / "abc123")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("abc123")
        if not weights:
            (repo / "snapshots" / "abc123" / "model.safetensors").unlink()
    out = resolve("org/complete")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "hub" / "models--org--complete" / "snapshots" / "abc123")
    out = resolve("org/partial")
    assert out.returncode != 0 and "ConfigError" in out.stderr and "org/partial" in out.stderr


def test_the_hub_dataset_is_split_as_tinyzero_splits_it():
    rows = [{"nums": [i, 1], "target": i + 1} for i in range(common.TINYZERO_TRAIN_ROWS + 5000)]
    train, test = common.split_tasks(rows, common.HUB_DATASET, 1024)
    assert len(train) == 327680 and train[-1] is rows[327679]
    assert test == rows[327680:328704]  # TinyZero's test rows, never the last rows of the file
    other_train, other_test = common.split_tasks(rows, "my_tasks.jsonl", 1024)
    assert other_test == rows[-1024:] and len(other_train) == len(rows) - 1024
    with pytest.raises(common.ConfigError, match="--test-size=9000 is not allowed"):
        common.split_tasks(rows, common.HUB_DATASET, 9000)


def test_health_warnings_come_once_each_and_only_when_due():
    health = bookkeeping.HealthCheck(patience=3)
    quiet = {"charts/zero_std_fraction": 0.5, "charts/format_rate": 0.2, "charts/truncated_fraction": 0.1,
             "losses/entropy": 2.0}
    assert health.check(quiet) == []
    stuck = {**quiet, "charts/zero_std_fraction": 1.0, "charts/format_rate": 0.0}
    assert health.check(stuck) == [] and health.check(stuck) == []  # not yet: 2 steps of 3
    said = health.check(stuck)
    assert len(said) == 2 and "equal rewards for 3 steps" in said[0] and "no completion was well-formed" in said[1]
    assert health.check(stuck) == []  # once each
    late = {**quiet, "charts/truncated_fraction": 0.9, "losses/entropy": 0.1}
    said = health.check(late)
    assert len(said) == 2 and "--max-new-tokens" in said[0] and "entropy fell from 2 to 0.1" in said[1]
    assert health.check(late) == []


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 1e6},
                                  {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                   "original_max_position_embeddings": 32768}])
def test_a_saved_config_reads_the_same_in_transformers_4_and_5(rope, tmp_path):
    """transformers 5 writes RoPE's settings under rope_parameters only; a 4.x reader takes a top-level
    rope_theta (default 10000) and rope_scaling (default none) and would silently change the model."""
    from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, rope_parameters=dict(rope))
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    assert "rope_theta" not in json.loads((tmp_path / "config.json").read_text())  # the 5.x file, as it comes
    common.write_portable_config(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved.get("rope_theta", 10000.0) == 1e6  # as 4.x reads it
    scaling = saved.get("rope_scaling")
    if rope["rope_type"] == "default":
        assert scaling is None
    else:
        assert scaling["type"] == "yarn" and scaling["factor"] == 4.0
    reloaded = AutoConfig.from_pretrained(tmp_path).rope_parameters  # and 5.x still reads what it wrote
    assert {k: reloaded[k] for k in rope} == rope


@pytest.mark.parametrize("temperature,entropy_grad", [(1.0, False), (0.7, True)])
def test_chunked_logprobs_match_the_full_vocabulary_pass(temperature, entropy_grad, tiny_model_dir):
    """The chunked output layer (never more than `chunk` positions' logits) gives the values and the
    gradients of the plain pass over (B, T, vocab) logits; chunk 7 leaves a ragged last chunk."""
    torch.manual_seed(0)
    model = common.load_model(tiny_model_dir, torch.device("cpu"))
    prompt_ids = torch.randint(0, 49152, (3, 5))
    prompt_mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    completion_ids = torch.randint(0, 49152, (3, 11))
    completion_mask = (torch.arange(11) < torch.tensor([[11], [4], [8]])).long()
    weights = torch.randn(3, 11)
    results = []
    for chunk in (0, 7):
        model.zero_grad()
        logprobs, entropy = common.completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                                       temperature, with_entropy=True, entropy_grad=entropy_grad,
                                                       chunk=chunk)
        loss = (logprobs * weights * completion_mask).sum() + (entropy * completion_mask).sum() * entropy_grad
        loss.backward()
        results.append((logprobs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, ent0, grads0), (lp1, ent1, grads1) = results
    assert torch.allclose(lp0, lp1, atol=1e-5) and torch.allclose(ent0, ent1, atol=1e-5)
    assert all(torch.allclose(grads0[n], grads1[n], atol=1e-5, rtol=1e-4) for n in grads0)
    assert any(g.abs().sum() > 0 for g in grads1.values())
    assert common.chunked_head_supported(model)


def test_a_token_budget_balances_micro_batches_instead_of_leaving_a_small_last_one():
    """16 rows of one length under a budget of 14 rows: a greedy fill gives 14 + 2 (a GPU idles on the 2);
    the split is 8 + 8. On random lengths the largest micro-batch is the smallest any contiguous split of
    the sorted rows into that many micro-batches achieves (checked by enumerating them)."""
    import itertools
    import random

    equal = synthetic_rollout(batch_size=16, completion_len=5)
    equal.completion_mask[:] = 1
    equal.prompt_mask[:] = 1
    split = common.micro_batches(equal, torch.arange(16), 16, max_tokens=14 * 11)
    assert [len(mb.idx) for mb in split] == [8, 8]
    rng = random.Random(0)
    for trial in range(30):
        n, width = rng.randint(2, 9), 12
        rollout = synthetic_rollout(batch_size=n, prompt_len=6, completion_len=width, seed=trial)
        rollout.completion_mask[:] = torch.tensor([[1] * k + [0] * (width - k) for k in
                                                   (rng.randint(1, width) for _ in range(n))])
        budget = rng.randint(18, 18 * n)
        found = common.micro_batches(rollout, torch.arange(n), n, max_tokens=budget)
        order = torch.cat([mb.idx for mb in found]).tolist()
        assert sorted(order) == list(range(n))
        padded = [mb.padded_tokens for mb in found]
        assert all(p <= budget or len(mb.idx) == 1 for p, mb in zip(padded, found))
        best = min(max(common.micro_batches(rollout, torch.tensor(order[a:b]), n)[0].padded_tokens
                       for a, b in zip((0,) + cuts, cuts + (n,)))
                   for cuts in itertools.combinations(range(1, n), len(found) - 1))
        assert max(padded) == best, (trial, padded, best)


def test_a_process_that_needs_fewer_micro_batches_never_makes_an_empty_one():
    """Under torchrun every process takes as many micro-batches as the one that needs most (here 8). These 9
    rows need 5 under a budget of 600 padded tokens, and the budget's search leaves them as 1, 1, 1, 1, 1, 2 and
    2 rows, with a single row the largest: splitting that one would leave an empty micro-batch (whose forward
    fails), so the largest of two or more rows is split instead."""
    lengths = dict(enumerate([(69, 230), (97, 23), (105, 177), (75, 290), (61, 68), (113, 3), (68, 53), (81, 178),
                              (106, 152)]))  # row: (prompt, completion) tokens
    order = sorted(lengths, key=lambda r: (lengths[r][1], lengths[r][0]), reverse=True)  # as micro_batches sorts
    assert len(common._fill(order, lengths, 600)) == 5
    groups = common._balanced(order, lengths, 600, count=8)
    assert len(groups) == 8 and all(groups)
    assert [row for group in groups for row in group] == order  # consecutive, every row once
    with pytest.raises(ValueError, match="9 rows cannot make 10 micro-batches"):
        common._balanced(order, lengths, 600, count=10)


def test_micro_batches_group_similar_lengths_within_a_token_budget():
    rollout = synthetic_rollout(batch_size=8)  # completion lengths 1 4 7 3 6 2 5 1, prompts 6 5 4 6 5 4 6 5
    rows = torch.arange(8)
    by_count = common.micro_batches(rollout, rows, 3)
    assert [len(mb.idx) for mb in by_count] == [3, 3, 2]
    assert [mb.completion_width for mb in by_count] == [7, 4, 1]  # longest first, each cut to its own length
    packed = common.micro_batches(rollout, rows, 8, max_tokens=24)
    assert sorted(torch.cat([mb.idx for mb in packed]).tolist()) == list(range(8))  # every row once
    assert all(mb.padded_tokens <= 24 or len(mb.idx) == 1 for mb in packed)
    mb = packed[0]
    ids, mask, cids, cmask = mb.inputs(rollout)
    assert cids.shape == (len(mb.idx), mb.completion_width) and ids.shape[1] == mb.prompt_width
    assert cmask.sum() == rollout.completion_mask[mb.idx].sum() and mask.sum() == rollout.prompt_mask[mb.idx].sum()
    assert torch.equal(mb(rollout.completion_mask.float())[:, -1].bool(), cmask[:, -1].bool())
