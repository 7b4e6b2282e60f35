"""evaluate.py: pass@k, and a run's checkpoint scored exactly as the run scored itself."""

import itertools
import json
import math

import pytest

import bookkeeping
import common
import evaluate
import grpo
from conftest import as_flags, read_metrics, run_script, tiny_args


@pytest.mark.parametrize("n,c,k", [(8, 0, 1), (8, 1, 1), (8, 3, 2), (8, 3, 5), (8, 3, 6), (8, 8, 8), (5, 2, 4)])
def test_pass_at_k_is_the_chance_that_k_drawn_samples_hold_a_correct_one(n, c, k):
    outcomes = [True] * c + [False] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    exact = sum(any(outcomes[i] for i in draw) for draw in draws) / len(draws)
    assert evaluate.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_a_runs_checkpoint_scores_as_its_final_evaluation(tiny_model_dir, tmp_path):
    """The run's own data settings (not evaluate.py's defaults), its newest checkpoint, the same prompt:
    greedy decoding then gives exactly the numbers the run logged at its last step."""
    tasks = dict(test_size=6, max_new_tokens=12, task_min_numbers=2, task_max_numbers=2, task_max_value=20,
                 task_operators="+*", prompt_template="base")
    args = tiny_args(grpo, model=tiny_model_dir, num_steps=2, eval_size=6, save_every=1, keep_checkpoints=0,
                     runs_dir=str(tmp_path), **tasks)
    out = grpo.train(args)
    result = run_script(["evaluate.py", out["run_dir"], "--out", str(tmp_path / "eval.jsonl"),
                         "--details", str(tmp_path / "details.jsonl")])
    assert result.returncode == 0, result.stderr[-3000:]
    scored = json.loads(result.stdout.strip().splitlines()[-1])
    assert scored["step"] == 2 and scored["tasks"] == 6 and scored["max_new_tokens"] == 12
    assert scored["greedy_accuracy"] == out["charts/eval_accuracy"]
    assert scored["format_rate"] == out["charts/eval_format_rate"]
    assert scored["response_length"] == pytest.approx(out["charts/eval_response_length"], abs=1e-9)
    assert json.loads((tmp_path / "eval.jsonl").read_text()) == scored
    assert scored["code_version"] == bookkeeping.code_version()  # the commit that scored it
    details = [json.loads(line) for line in (tmp_path / "details.jsonl").read_text().splitlines()]
    assert len(details) == 6 and sum(d["correct"] for d in details) / 6 == scored["greedy_accuracy"]
    # the baselines beside the accuracy are the run's own on the same tasks (3 sums, 3 products: no constant
    # answer scores more than half), and the per-class table counts every task once
    assert scored["best_constant"] == out["charts/eval_best_constant"] <= 0.5
    assert scored["uniform_guess"] == out["charts/eval_uniform_guess"]
    assert scored["gain_over_best_constant"] == scored["greedy_accuracy"] - scored["best_constant"]
    assert max(scored["best_constant_by_operators"].values()) == scored["best_constant"]
    classes = scored["by_operator_class"]
    assert {cls: entry["tasks"] for cls, entry in classes.items()} == {"+": 3, "*": 3}
    assert sum(entry["accuracy"] * entry["tasks"] for entry in classes.values()) == pytest.approx(
        sum(d["correct"] for d in details))
    assert sum(entry["uniform_guess"] * entry["tasks"] for entry in classes.values()) / 6 == pytest.approx(
        scored["uniform_guess"])  # each class's own uniform guess, weighted by its tasks, is the whole set's
    # the step-0 row of the run is the starting model: evaluating that model gives the same numbers
    base = run_script(["evaluate.py", tiny_model_dir, *as_flags(**tasks)])
    assert base.returncode == 0, base.stderr[-3000:]
    step0 = read_metrics(out["run_dir"])[1][0]
    assert step0["step"] == 0
    assert json.loads(base.stdout.strip().splitlines()[-1])["response_length"] == pytest.approx(
        step0["charts/eval_response_length"], abs=1e-9)


def test_sampled_pass_at_k_is_reported_and_bounded(tiny_model_dir):
    result = run_script(["evaluate.py", tiny_model_dir, "--size", "2", "--samples", "3", "--max-new-tokens", "4"])
    assert result.returncode == 0, result.stderr[-3000:]
    scored = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(scored) >= {"pass@1", "pass@2", "pass@3", "sampled_accuracy"}
    assert scored["pass@1"] == pytest.approx(scored["sampled_accuracy"])  # pass@1 is the mean accuracy
    assert all(0.0 <= scored[f"pass@{k}"] <= 1.0 and math.isfinite(scored[f"pass@{k}"]) for k in (1, 2, 3))
    assert scored["sampled_format_rate"] == 0.0  # 4 random tokens never close an <answer> tag


class ScriptedSamples:
    """Stands in for the model where only the counting is under test: each prompt's samples are given texts."""

    def __init__(self, texts_per_prompt):
        self.texts_per_prompt, self.calls = list(texts_per_prompt), 0

    def generate(self, prompts, num_samples, *args, **kwargs):
        texts = [t for _ in prompts for t in self.texts_per_prompt.pop(0)]
        assert len(texts) == len(prompts) * num_samples
        self.calls += 1
        return type("Rollout", (), {"texts": texts})


def test_sampled_format_rate_and_accuracy_count_every_sample(tiny_model_dir):
    """Two tasks x 4 samples in one generate call (batch 8 // 4): the first task's samples are 2
    right, 1 well-formed but wrong, 1 malformed; the second's 1 well-formed but wrong and 3 malformed."""
    answer = "</think>\n<answer> {} </answer>"
    tasks = [{"nums": [3, 5], "target": 8}, {"nums": [4, 6], "target": 24}]
    backend = ScriptedSamples([[answer.format("3 + 5"), answer.format("5 + 3"), answer.format("3 * 5"), "no answer"],
                               [answer.format("4 + 6"), "<answer> 4 * 6", "", "4 * 6"]])
    args = evaluate.Args(target="unused", samples=4, batch_size=8, max_new_tokens=8, prompt_template="base")
    scored = evaluate.sampled_scores(backend, common.load_tokenizer(tiny_model_dir), tasks, args, common.Dist())
    assert backend.calls == 1
    assert scored["sampled_format_rate"] == (3 / 4 + 1 / 4) / 2
    assert scored["sampled_accuracy"] == (2 / 4 + 0 / 4) / 2
    assert scored["pass@4"] == 1 / 2  # the first task has a right sample, the second none


@pytest.mark.parametrize("make,message", [
    (lambda p: (p / "args.json").write_text("{}"), "has no intact checkpoint"),
    (lambda p: (p / "args.json").write_text("[1, 2]"), "args.json is not a JSON object"),
    (lambda p: None, "no config.json"),
])
def test_a_target_that_cannot_be_scored_is_a_one_line_error(make, message, tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    make(folder)
    result = run_script(["evaluate.py", str(folder)])
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_torchrun_shards_the_tasks_and_sums_the_same_scores(tiny_model_dir):
    flags = [tiny_model_dir, "--size", "5", "--max-new-tokens", "6", "--samples", "2"]
    one = run_script(["evaluate.py", *flags])
    two = run_script(["evaluate.py", *flags], torchrun=True, threads="1")
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    single, sharded = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (one, two))
    assert sharded["tasks"] == single["tasks"] == 5  # 3 + 2 tasks, the padding task not counted
    for key in ("greedy_accuracy", "format_rate", "response_length"):
        assert sharded[key] == pytest.approx(single[key], abs=1e-9), key
