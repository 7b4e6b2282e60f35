"""The evidence a skeptic asks for: the constant-answer baselines computed exactly, held-out splits that no
constant answer does well on, a warm start whose answers ignore the target, and runs that record their code."""

import collections
import hashlib
import json
import os
import random
import re
import shutil
from fractions import Fraction
from pathlib import Path
import subprocess
import sys

import pytest
import torch

import common
import countdown_reward
import grpo
import ppo
from conftest import ROOT, even_token_reward, read_metrics, script_args, tiny_args
from test_study import load

warm_start = load("warm_start")
evaluate_script = __import__("evaluate")

RUNG = dict(min_numbers=2, max_numbers=2, max_value=20, operators="+-")


def scored_by_the_reward(template, nums, target) -> bool:
    text = common.template_text(template)
    for i, n in sorted(enumerate(nums), reverse=True):  # n10 before n1
        text = text.replace(f"n{i + 1}", str(n))
    return countdown_reward.is_correct(f"</think>\n<answer> {text} </answer>", nums, target)


def test_templates_cover_every_expression_and_score_as_the_reward_does():
    assert [len(common.expression_templates(k)) for k in (1, 2, 3, 4)] == [1, 8, 192, 7680]
    rng = random.Random(0)
    templates = common.expression_templates(3)
    for _ in range(12):  # random tasks whose target some template reaches, and some no template reaches
        nums = [rng.randint(1, 12) for _ in range(3)]
        reached = common.template_value(rng.choice(templates), nums)
        target = int(reached) if reached and reached.denominator == 1 and rng.random() < 0.5 else rng.randint(1, 99)
        for t in templates:
            assert (common.template_value(t, nums) == target) == scored_by_the_reward(t, nums, target), \
                (common.template_text(t), nums, target)


def test_best_constant_and_uniform_guess_by_hand():
    tasks = [{"nums": [3, 5], "target": 8},    # n1 + n2, n2 + n1
             {"nums": [9, 4], "target": 5},    # n1 - n2
             {"nums": [2, 7], "target": 5},    # n2 - n1
             {"nums": [6, 3], "target": 18},   # n1 * n2, n2 * n1
             {"nums": [8, 2], "target": 4}]    # n1 / n2
    baselines = common.constant_baselines(tasks)
    assert baselines["best_constant"] == pytest.approx(1 / 5)  # no template answers two of them
    assert baselines["uniform_guess"] == pytest.approx((2 + 1 + 1 + 2 + 1) / 8 / 5)
    sums = [{"nums": [a, b], "target": a + b} for a, b in [(1, 2), (7, 3), (4, 4)]]
    assert common.constant_baselines(sums + tasks[1:2])["best_constant"] == pytest.approx(3 / 4)
    assert common.constant_baselines(sums)["best_constant_template"] == "n1 + n2"
    # each operator pattern's best template: "always add" 3 of 4, "always subtract" 1 (9 - 4), the others none
    assert common.constant_baselines(sums + tasks[1:2])["best_by_operators"] == {"+": 0.75, "-": 0.25, "*": 0.0,
                                                                                 "/": 0.0}
    three = [{"nums": [2, 3, 4], "target": 20}]  # (n1 + n2) * n3 and its mirror images
    assert common.constant_baselines(three)["best_constant"] == 1.0
    assert common.constant_baselines(three)["best_by_operators"]["*+"] == 1.0  # (n1 + n2) * n3
    assert common.constant_baselines(three)["best_by_operators"]["++"] == 0.0
    assert common.constant_baselines([{"nums": [1, 2, 3, 4, 5], "target": 15}]) is None


@pytest.mark.parametrize("operators,best", [("+-", 0.5), ("+*", 0.5), ("+-*", 0.34)])
def test_held_out_splits_are_balanced_so_no_constant_answer_does_well(operators, best):
    train, test = common.load_countdown("generated", 128, seed=1, **{**RUNG, "operators": operators})
    shares = collections.Counter(map(common.operator_class, test))
    assert len(shares) == len(operators) and max(shares.values()) - min(shares.values()) <= 1
    assert common.constant_baselines(test)["best_constant"] <= best
    assert not {common.task_key(t) for t in train} & {common.task_key(t) for t in test}
    # the generator does not under-sample differences (a negative draw used to be rejected: 146 sums, 126)
    train_shares = collections.Counter(map(common.operator_class, train))
    assert max(train_shares.values()) - min(train_shares.values()) < 0.1 * len(train)


def test_study_readme_rung_table_is_what_each_ladder_rungs_held_out_split_scores():
    """study/README.md's rung table (split, best constant, uniform guess) is recomputed from the ladder's own
    task flags over the scripts' defaults, on the fixed 128-task held-out split: the docs cannot drift."""
    study = load("run")
    table = (ROOT / "study" / "README.md").read_text().split("| rung | `--task-*` |", 1)[1].split("\n\n", 1)[0]
    rows = {cells[0].split()[0]: cells for cells in (  # "2 (the CPU rung)" is rung 2
        [c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:])}
    rungs = {name.split("-")[0].removeprefix("rung"): flags for name, _, flags in study.EXPERIMENTS["ladder"][1]}
    assert set(rows) == set(rungs)
    for rung, flags in rungs.items():
        task = script_args(grpo, **flags).task
        _, test = common.load_countdown("generated", 128, seed=1, train_size=1, min_numbers=task.task_min_numbers,
                                        max_numbers=task.task_max_numbers, max_value=task.task_max_value,
                                        operators=task.task_operators)
        baselines = common.constant_baselines(test)
        shares = collections.Counter(map(common.operator_class, test))
        written = [float(cell.split()[0].rstrip("%")) for cell in rows[rung][3:5]]  # "100%", "33.6% (`n1 + ...`)"
        computed = [float(study.percent(baselines[key]).rstrip("%")) for key in ("best_constant", "uniform_guess")]
        assert written == computed, rung
        # the split column counts each class ("64 sums, 64 products", "43 `++`, ..."), or says how many there are
        named = {"sums": "+", "differences": "-", "products": "*"}
        written = {named.get(cls, cls.strip("`")): int(n)
                   for n, cls in re.findall(r"(\d+) (sums|differences|products|`[^`]+`)", rows[rung][2])}
        classes = re.match(r"(\d+) operator classes", rows[rung][2])
        assert (len(shares) == int(classes[1])) if classes else (written == dict(shares)), rung


def test_every_evaluation_reports_its_baselines(tiny_model_dir):
    tokenizer = common.load_tokenizer(tiny_model_dir)
    model = common.load_model(tiny_model_dir, "cpu", trainable=False)
    backend = common.make_backend("hf", model, tokenizer)
    _, test = common.load_countdown("generated", 8, seed=1, **RUNG)
    details = []
    scores = common.evaluate(backend, tokenizer, test, 3, common.setup_distributed("cpu"), details=details)
    assert scores["charts/eval_best_constant"] == 0.5 and scores["charts/eval_uniform_guess"] == 0.1875
    assert [d["nums"] for d in details] == [t["nums"] for t in test] and all("completion" in d for d in details)


@pytest.mark.parametrize("trace", ["guess", "search"])
def test_warm_start_answers_do_not_depend_on_which_operator_is_right(trace):
    """On two-number examples the share of `+` answers is the same whether or not the target is the sum:
    the label carries no information about the right operator (the earlier warm start never used `+` where
    `+` was right)."""
    examples = warm_start.examples(script_args(warm_start, trace=trace), 4000, exclude=set())
    two = [e for e in examples if len(e["nums"]) == 2]
    plus = lambda e: " + " in e["completion"].split("<answer>")[1]  # noqa: E731
    is_sum = [e for e in two if e["target"] == sum(e["nums"])]
    not_sum = [e for e in two if e["target"] != sum(e["nums"])]
    assert len(is_sum) > 200 and len(not_sum) > 200
    share = lambda group: sum(map(plus, group)) / len(group)  # noqa: E731
    assert abs(share(is_sum) - share(not_sum)) < 0.06 and abs(share(two) - 0.25) < 0.04
    correct = sum(countdown_reward.is_correct(e["completion"], e["nums"], e["target"]) for e in examples)
    assert 0 < correct < 0.2 * len(examples)  # right by chance only
    for e in examples:
        assert countdown_reward.is_well_formed(e["completion"]) and min(e["nums"]) >= warm_start.MIN_VALUE
        assert f"The target is {e['target']}." in e["completion"]


def test_warm_start_search_works_out_each_try_and_answers_the_last_whatever_the_target():
    """--trace search: every `Try E = V.` states E's exact value, the answer is the last try, and a try that
    hits the target is followed by another as often as one that misses (a stop rule that looked at the
    target would teach the answer)."""
    examples = warm_start.examples(script_args(warm_start, trace="search", max_tries=3), 3000, exclude=set())
    went_on = collections.defaultdict(list)  # did another try follow, for tries that hit and that missed
    how_many = collections.Counter()
    for e in examples:
        tries = re.findall(r" Try ([^=]+) = (-?\d+(?:/\d+)?)\.", e["completion"])
        how_many[len(tries)] += 1
        for i, (expr, value) in enumerate(tries):
            assert countdown_reward.evaluate_equation(expr) == Fraction(value), (expr, value)
            if i < 2:
                went_on[Fraction(value) == e["target"]].append(i < len(tries) - 1)
        answer = countdown_reward.extract_answer(e["completion"])
        assert answer == tries[-1][0] and f"I will try {answer}." in e["completion"]
    assert set(how_many) == {1, 2, 3} and all(abs(n / len(examples) - 1 / 3) < 0.04 for n in how_many.values())
    rate = {hit: sum(flags) / len(flags) for hit, flags in went_on.items()}
    assert len(went_on[True]) > 150 and abs(rate[True] - rate[False]) < 0.1, rate


def test_warm_start_label_table_names_the_right_operator_in_either_order():
    """A difference or quotient is right whichever number comes first; examples of three numbers are left out."""
    answer = lambda expr: f" The target is 0. I will try {expr}.</think>\n<answer> {expr} </answer>"  # noqa: E731
    data = [{"nums": [30, 25], "target": 55, "completion": answer("30 - 25")},
            {"nums": [25, 30], "target": 5, "completion": answer("30 - 25")},
            {"nums": [21, 84], "target": 4, "completion": answer("84 * 21")},
            {"nums": [21, 84], "target": 4, "completion": answer("84 / 21")},
            {"nums": [22, 23], "target": 7, "completion": answer("23 + 22")},
            {"nums": [21, 22, 23], "target": 66, "completion": answer("23 + 22 + 21")}]
    assert warm_start.label_table(data) == {"+": {"-": 1}, "-": {"-": 1}, "/": {"*": 1, "/": 1}, "none": {"+": 1}}


def test_warm_start_labels_only_prints_the_trained_examples_table_and_touches_nothing(tmp_path, capsys):
    """--labels-only describes exactly the examples a build with the same settings trains on, without a
    model, and leaves --out alone even where a build would refuse it."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")  # a build refuses this folder: it holds no warm_start.json
    before = sorted(tmp_path.rglob("*"))
    args = script_args(warm_start, out=str(precious), model="no-such-model", num_steps=5, batch_size=8,
                       labels_only=True)
    warm_start.main(args)
    printed = json.loads(capsys.readouterr().out)
    data = warm_start.training_examples(args)
    assert printed["examples"] == len(data) == 40 and sorted(tmp_path.rglob("*")) == before
    with pytest.raises(common.ConfigError, match="--out=.*not written by study/warm_start.py"):
        warm_start.main(script_args(warm_start, out=str(precious), model="no-such-model"))
    table = printed["two_number_examples_by_right_operator"]
    assert sum(map(sum, (row.values() for row in table.values()))) == sum(len(e["nums"]) == 2 for e in data) > 0


def test_warm_start_never_shows_a_held_out_task():
    _, held_out = common.load_countdown("generated", 64, seed=1, min_numbers=2, max_numbers=3, max_value=99,
                                        operators="+-*/")
    keys = {common.task_key(t) for t in held_out}
    args = script_args(warm_start)
    unfiltered = warm_start.examples(args, 3000, exclude=set())
    assert {common.task_key(e) for e in unfiltered} & keys  # the test is able to fail: some collide
    assert not {common.task_key(e) for e in warm_start.examples(args, 3000, exclude=keys)} & keys


def test_warm_start_keeps_folders_it_did_not_write(tiny_model_dir, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    args = script_args(warm_start, out=str(precious), model=tiny_model_dir, num_steps=1, batch_size=2)
    with pytest.raises(common.ConfigError, match="--out=.*not written by study/warm_start.py"):
        warm_start.main(args)
    assert (precious / "notes.txt").read_text() == "keep me"
    out = tmp_path / "warm"
    for _ in range(2):  # the second replaces the first, an earlier warm start
        warm_start.main(script_args(warm_start, out=str(out), model=tiny_model_dir, num_steps=1, batch_size=2))
    record = json.loads((out / warm_start.MARKER).read_text())
    assert record["num_steps"] == 1 and "labels_only" not in record  # resume compares the record's settings
    common.check_model_folder(str(out))
    for kept in ("eval.jsonl", "notes.txt"):  # an evaluation beside the model (study/results/cpu/warm_start), notes
        (out / kept).write_text("{}\n")
        with pytest.raises(common.ConfigError, match=f"--out=.*besides an earlier warm start it holds {kept}"):
            warm_start.main(script_args(warm_start, out=str(out), model=tiny_model_dir, num_steps=1, batch_size=2))
        (out / kept).unlink()
    # a file the MARKER lists as written with the model (a sentencepiece tokenizer's spiece.model): replaced
    record = json.loads((out / warm_start.MARKER).read_text())
    assert set(record["files"]) == {p.name for p in out.iterdir()}
    (out / "spiece.model").write_bytes(b"\x00")
    (out / warm_start.MARKER).write_text(json.dumps({**record, "files": [*record["files"], "spiece.model"]}))
    warm_start.main(script_args(warm_start, out=str(out), model=tiny_model_dir, num_steps=1, batch_size=2))
    assert not (out / "spiece.model").exists()
    record = json.loads((out / warm_start.MARKER).read_text())
    (out / warm_start.MARKER).write_text(json.dumps({**record, "files": [*record["files"], "notes", "link.txt"]}))
    (out / "notes").mkdir()  # listed, but a folder or a link is never the model's: refused
    (out / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(common.ConfigError, match="--out=.*besides an earlier warm start it holds notes"):
        warm_start.main(script_args(warm_start, out=str(out), model=tiny_model_dir, num_steps=1, batch_size=2))
    shutil.rmtree(out / "notes")
    (out / "link.txt").symlink_to(tmp_path / "precious" / "notes.txt")
    with pytest.raises(common.ConfigError, match="--out=.*besides an earlier warm start it holds link.txt"):
        warm_start.main(script_args(warm_start, out=str(out), model=tiny_model_dir, num_steps=1, batch_size=2))
    (out / "link.txt").unlink()
    lock, elsewhere = warm_start.lock_path(out), tmp_path / "elsewhere.txt"
    elsewhere.write_text("keep me")
    lock.unlink()
    lock.symlink_to(elsewhere)
    with pytest.raises(common.ConfigError, match="--out=.*its lock .* is a symbolic link"):
        warm_start.main(script_args(warm_start, out=str(out), model=tiny_model_dir, num_steps=1, batch_size=2))
    assert elsewhere.read_text() == "keep me"
    lock.unlink()
    elsewhere.unlink()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["precious", "warm"]


def test_a_failed_publish_puts_the_earlier_warm_start_back(tiny_model_dir, tmp_path, monkeypatch):
    import os

    out = tmp_path / "warm"
    model, tokenizer = common.load_model(tiny_model_dir, torch.device("cpu")), common.load_tokenizer(tiny_model_dir)
    warm_start.publish(model, tokenizer, out, {"num_steps": 1})
    rename = os.replace

    def disk_full_for_the_new_one(src, dst):  # the new folder cannot be renamed into place
        if ".old." not in str(src) and Path(src).name.startswith(f".{out.name}."):
            raise OSError(28, "No space left on device")
        return rename(src, dst)
    monkeypatch.setattr(warm_start.os, "replace", disk_full_for_the_new_one)
    with pytest.raises(OSError, match="No space left"):
        warm_start.publish(model, tokenizer, out, {"num_steps": 2})
    assert json.loads((out / warm_start.MARKER).read_text())["num_steps"] == 1
    common.check_model_folder(str(out))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["warm"]


def test_every_committed_rebuild_of_the_warm_start_answers_as_the_first_and_the_study_names_it():
    """study/README.md says the third and later builds of `bundled-warm`, which later runs started from, answer the
    CPU rung's held-out tasks byte for byte as the first build did: each committed evaluation of a rebuild must
    match, and each must be named there (a build evaluated and committed but not reported fails too)."""
    folder = ROOT / "study" / "results" / "cpu" / "warm_start"
    first = (folder / "eval_details.jsonl").read_bytes()
    rebuilds = sorted(folder.glob("eval_rebuild_details.jsonl")) + sorted(folder.glob("eval_build*_details.jsonl"))
    assert len(rebuilds) >= 7 and len(first.splitlines()) == 128
    readme = (ROOT / "study" / "README.md").read_text()
    for path in rebuilds:
        assert path.read_bytes() == first, path.name
        assert f"`{path.name}`" in readme, path.name


def test_evaluate_checks_its_output_paths_before_evaluating(tmp_path):
    for flag in ("--out", "--details"):
        result = subprocess.run([sys.executable, "evaluate.py", "bundled", flag, str(tmp_path / "missing" / "x.jsonl")],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and flag[2:] in result.stderr and "Traceback" not in result.stderr
        assert "greedy_accuracy" not in result.stdout


def test_evaluate_never_writes_through_a_link_nor_both_records_into_one_file(tmp_path):
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("keep me")
    (tmp_path / "link.jsonl").symlink_to(elsewhere)
    for out, details in ((str(tmp_path / "link.jsonl"), ""), ("", str(tmp_path / "link.jsonl"))):
        with pytest.raises(common.ConfigError, match="not a symbolic link"):
            evaluate_script.check_outputs(out, details)
    same = str(tmp_path / "eval.jsonl")
    with pytest.raises(common.ConfigError, match="--details=.*another file than --out"):
        evaluate_script.check_outputs(same, str(tmp_path / "." / "eval.jsonl"))
    (tmp_path / "eval.jsonl").write_text("{}\n")
    (tmp_path / "hard.jsonl").hardlink_to(tmp_path / "eval.jsonl")  # one file under two names
    with pytest.raises(common.ConfigError, match="--details=.*another file than --out"):
        evaluate_script.check_outputs(same, str(tmp_path / "hard.jsonl"))
    evaluate_script.check_outputs(same, str(tmp_path / "eval_details.jsonl"))
    with pytest.raises(common.ConfigError, match="--details=.*a file name of at most 241 bytes"):
        evaluate_script.check_outputs("", str(tmp_path / ("d" * 238 + ".jsonl")))  # its temporary name: too long
    evaluate_script.check_outputs("", str(tmp_path / ("d" * 235 + ".jsonl")))
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)  # an open() of it would block, and a write would go to whoever reads it
    with pytest.raises(common.ConfigError, match="--out=.*a regular file, not a folder, pipe or device"):
        evaluate_script.check_outputs(str(fifo), "")
    assert elsewhere.read_text() == "keep me"


def test_evaluate_reports_accuracy_per_operator_class():
    details = [{"operator_class": "+", "correct": True, "chosen_operators": "+"},
               {"operator_class": "+", "correct": False, "chosen_operators": "-"},
               {"operator_class": "-", "correct": False, "chosen_operators": "+"}]
    table = evaluate_script.by_operator_class(details)
    assert table == {"+": {"tasks": 2, "accuracy": 0.5, "chosen": {"+": 1, "-": 1}},
                     "-": {"tasks": 1, "accuracy": 0.0, "chosen": {"+": 1}}}
    assert evaluate_script.answer_operators("x</think>\n<answer> (3 * 4) - 2 </answer>") == "*-"
    assert evaluate_script.answer_operators("no answer") == "none"


def test_each_operator_class_has_its_own_uniform_guess():
    """A random template (8 of them for two numbers) is right on 2 + 2 = 4 four ways (either order of + and *),
    on 3 + 5 = 8 two ways, and on 6 / 3 = 2 once: the sums' uniform guess is (4 + 2) / 8 / 2, the quotient's 1 / 8."""
    details = [{"nums": [2, 2], "target": 4, "operator_class": "+", "correct": True, "chosen_operators": "+"},
               {"nums": [3, 5], "target": 8, "operator_class": "+", "correct": False, "chosen_operators": "*"},
               {"nums": [6, 3], "target": 2, "operator_class": "/", "correct": False, "chosen_operators": "-"}]
    table = evaluate_script.by_operator_class(details)
    assert {cls: entry["uniform_guess"] for cls, entry in table.items()} == {"+": 0.375, "/": 0.125}
    assert load("run").class_uniform_guesses(Path("no-such-file")) == {}


def test_a_run_records_its_code_version_and_ppo_logs_kl_to_the_reference(tiny_model_dir, tmp_path, capsys):
    """args.json names the commit, and the warm start the run began from: its settings and the commit that made
    it (what --model=bundled-warm resolves to is a cached folder whose name says neither)."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    warm = tmp_path / "warm"
    warm_start.main(script_args(warm_start, out=str(warm), model=tiny_model_dir, num_steps=1, batch_size=2, seed=7))
    made = json.loads((warm / warm_start.MARKER).read_text())
    assert made["code_version"]["commit"] == head and made["seed"] == 7
    assert made["weights_sha256"] == {"model.safetensors": hashlib.sha256((warm / "model.safetensors").read_bytes())
                                      .hexdigest()}
    result = ppo.train(tiny_args(ppo, model=str(warm), group_size=1, eval_size=2, test_size=4,
                                 runs_dir=str(tmp_path / "runs")))
    saved = json.loads(open(f"{result['run_dir']}/args.json").read())
    (version,) = saved["code_versions"]
    assert version["commit"] == head and isinstance(version["dirty"], bool)
    assert Path(saved["model_source"]["path"]).resolve() == warm.resolve()
    assert saved["model_source"]["warm_start"] == {k: v for k, v in made.items() if k != "files"}
    _, rows = read_metrics(tmp_path / "runs")
    assert rows[-1]["losses/kl_ref"] >= 0 and "charts/eval_best_constant" in rows[0]
    # the terminal shows each evaluation beside its baselines, as logged
    shown = [line for line in capsys.readouterr().err.splitlines() if "held-out greedy accuracy" in line]
    assert [line.split(":")[0] for line in shown] == [f"step {r['step']}" for r in rows if "charts/eval_accuracy" in r]
    first = rows[0]
    gain = 100 * (first["charts/eval_accuracy"] - first["charts/eval_best_constant"])
    assert f"{first['charts/eval_accuracy']:.1%}, {gain:+.1f} points over the best constant answer " \
           f"({first['charts/eval_best_constant']:.1%})" in shown[0]
    # a model that no warm start made records its folder alone
    result = grpo.train(tiny_args(grpo, model=tiny_model_dir, num_steps=1, eval_size=2, test_size=4,
                                  runs_dir=str(tmp_path / "plain")))
    saved = json.loads(open(f"{result['run_dir']}/args.json").read())
    assert Path(saved["model_source"]["path"]).resolve() == Path(tiny_model_dir).resolve()
    assert "warm_start" not in saved["model_source"]


@pytest.mark.parametrize("script", ["ppo", "grpo", "dapo"])
def test_kl_to_the_reference_is_logged_only_where_there_is_a_reference(script, tiny_model_dir, tmp_path):
    """beta = 0 loads no reference model, so its KL is not measured: a logged 0 would draw a flat line nobody
    measured on the paper's KL panels (DAPO's default). With beta > 0 every script logs a measured value."""
    import importlib

    algo = importlib.import_module(script)
    for beta in (0.0, 0.05):
        algo.train(tiny_args(algo, model=tiny_model_dir, beta=beta, num_steps=2, eval_size=0,
                             runs_dir=str(tmp_path / str(beta)), group_size=1 if script == "ppo" else 2,
                             **({"dynamic_sampling": False} if script == "dapo" else {})),
                   reward_fn=even_token_reward)  # rewards that differ within a group: the policy moves
        _, rows = read_metrics(tmp_path / str(beta))
        trained = [r for r in rows if "losses/policy_loss" in r]
        assert len(trained) == 2
        if beta == 0:
            assert not any("losses/kl_ref" in r for r in rows)
        else:
            assert all(r["losses/kl_ref"] >= 0 for r in trained) and trained[-1]["losses/kl_ref"] > 0


def test_the_code_version_is_dirty_for_code_changes_only(tmp_path):
    """A study adds and edits results beside the code: only a changed or added .py or requirements file is `dirty`
    (a new module in a new folder too), not an ignored one."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--local", str(ROOT), str(clone)], check=True)

    def dirty() -> bool:
        code = "import bookkeeping, json; print(json.dumps(bookkeeping.code_version()))"
        out = subprocess.run([sys.executable, "-c", code], cwd=clone, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.splitlines()[-1])["dirty"]

    assert dirty() is False
    (clone / "study" / "README.md").write_text("edited")
    next(clone.glob("study/results/cpu/*/*/metrics.jsonl")).unlink()
    (clone / "study" / "results" / "cpu" / "new_run").mkdir()
    (clone / "study" / "results" / "cpu" / "new_run" / "metrics.jsonl").write_text("{}\n")
    (clone / "runs").mkdir(exist_ok=True)
    (clone / "runs" / "scratch.py").write_text("print()\n")  # runs/ is ignored: a run folder, not code
    assert dirty() is False
    (clone / "helpers").mkdir()
    (clone / "helpers" / "reward_hack.py").write_text("print()\n")
    assert dirty() is True
    (clone / "helpers" / "reward_hack.py").unlink()
    assert dirty() is False
    (clone / "grpo.py").write_text((clone / "grpo.py").read_text() + "\n# edited\n")
    assert dirty() is True


def test_ppo_kl_to_the_reference_is_grpos_estimate():
    import torch

    torch.manual_seed(0)
    logprobs, ref = -torch.rand(4, 6) * 3, -torch.rand(4, 6) * 3
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 1 + [0] * 5, [1] * 5 + [0]], dtype=torch.float32)
    ref[mask == 0] = 1e4  # garbage in padded positions
    expected = grpo.sequence_mean(grpo.kl_k3(logprobs, ref), mask)
    assert ppo.kl_to_reference(logprobs, ref, mask).item() == pytest.approx(expected.item(), rel=1e-6)


def test_sizes_are_bounded_by_what_fits_with_the_reason(tmp_path):
    for flags in (["--samples", "1000000000"], ["--test-size", "1000000000"]):
        result = subprocess.run([sys.executable, "evaluate.py", "bundled", *flags], cwd=ROOT, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 2 and flags[0] in result.stderr and "Traceback" not in result.stderr
    with pytest.raises(common.ConfigError, match="--test-size=1000000000 is not allowed: in \\[1, 100000\\]"):
        grpo.check_args(script_args(grpo, test_size=10**9, eval_size=1), 1)


def test_step_breakdown_pools_each_variants_training_steps_and_counts_tokens_as_the_model_sees_them(tmp_path,
                                                                                                  tokenizer):
    step_breakdown = load("step_breakdown", "benchmark")

    def run(name, updates, lengths, prompts):
        folder = tmp_path / "experiment" / name
        folder.mkdir(parents=True)
        rows = [{"step": 0, "time/eval": 50.0, "charts/eval_response_length": 99.0}]  # the step-0 evaluation
        rows += [{"step": i + 1, "time/generation": 1.0 + i, "time/update": u, "time/step": u + 1.0 + i,
                  "charts/response_length": length} for i, (u, length) in enumerate(zip(updates, lengths))]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        # the logged text has no stop token; the completion length that counts is the metrics' (stop included)
        samples = [dict(step=1, prompt=p, completion=" 3 + 4", reward=0.0) for p in prompts]
        (folder / "samples.jsonl").write_text("".join(json.dumps(sample) + "\n" for sample in samples))
        return folder

    prompts = [common.make_prompt(tokenizer, dict(nums=[3, 4], target=7)),
               common.make_prompt(tokenizer, dict(nums=[13, 14], target=182))]
    first = run("G4__1__100", [10.0, 30.0, 50.0], [30.0, 32.0, 34.0], prompts[:1])
    second = run("G4__2__200", [20.0, 40.0], [36.0, 38.0], prompts[1:])
    other = run("G2__1__300", [7.0], [5.0], prompts[:1])
    got = step_breakdown.breakdown([first, second, other], tokenizer)

    assert set(got) == {"experiment/G4", "experiment/G2"}
    g4 = got["experiment/G4"]
    assert (g4["runs"], g4["steps"]) == (2, 5)
    assert (g4["generation"], g4["update"], g4["step"]) == (2.0, 30.0, 32.0)  # medians over both seeds' steps
    _, masks = common.encode_prompts(tokenizer, prompts, 1, "cpu")  # left-padded as the scripts encode them
    assert g4["prompt"] == masks.sum().item() / 2 and g4["completion"] == 34.0
    assert (got["experiment/G2"]["update"], got["experiment/G2"]["completion"]) == (7.0, 5.0)


def test_time_to_gain_counts_every_logged_minute_up_to_the_first_evaluation_clear_of_the_best_constant():
    time_to_gain = load("time_to_gain", "benchmark")
    evaluation = lambda step, accuracy: {"step": step, "charts/eval_accuracy": accuracy, "time/eval": 60.0,
                                         "charts/eval_best_constant": 0.5}
    rows = [evaluation(0, 0.9)]  # the starting model: no gain of training, however high
    rows += [{"step": s, "time/step": 30.0} for s in (1, 2)] + [evaluation(2, 0.5390625)]  # 4.0 points: short
    rows += [{"step": s, "time/step": 30.0} for s in (3, 4)] + [evaluation(4, 0.55)]  # exactly 5 points
    rows += [{"step": 5, "time/step": 30.0}, evaluation(5, 0.7)]
    got = time_to_gain.first_gain(rows, margin=0.05)
    assert (got["step"], got["accuracy"], got["gained"]) == (4, 0.55, True)
    assert got["minutes"] == (3 * 60.0 + 4 * 30.0) / 60  # three evaluations and four steps
    never = time_to_gain.first_gain(rows[:4], margin=0.05)
    assert (never["step"], never["gained"], never["minutes"]) == (2, False, (2 * 60.0 + 2 * 30.0) / 60)
    assert time_to_gain.first_gain(rows, margin=0.2)["step"] == 5
    unjudged = [{"step": 0, "charts/eval_accuracy": 0.9, "time/eval": 60.0}]  # logged before the baselines were
    assert time_to_gain.first_gain(unjudged, margin=0.05) == dict(step=None, accuracy=None, best_constant=None,
                                                                  minutes=1.0, gained=False)
    edited = [{"step": 0, "time/eval": float("nan")}, {"step": 1, "time/step": 30.0},
              {"step": 1, "charts/eval_accuracy": float("inf"), "charts/eval_best_constant": 0.5}]
    assert time_to_gain.first_gain(edited, margin=0.05) == dict(step=None, accuracy=None, best_constant=None,
                                                                minutes=0.5, gained=False)


def test_same_updates_records_both_commits_and_refuses_a_before_that_is_not_one(capsys):
    same_updates = load("same_updates", "benchmark")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    versions = same_updates.compared_versions("HEAD")
    assert versions["before"] == "HEAD" and versions["before_commit"] == head
    assert versions["after"]["commit"] == head and isinstance(versions["after"]["dirty"], bool)
    with pytest.raises(SystemExit) as refused:
        same_updates.compared_versions("no-such-commit")
    assert refused.value.code == 2  # not 1, which says the weights differ
    assert capsys.readouterr().err.startswith("--before 'no-such-commit' is not a commit of")
