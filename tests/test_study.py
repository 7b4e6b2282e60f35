"""study/: every command of the paper's study is a valid configuration, and a stopped study resumes."""

import decimal
import errno
import importlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import statistics
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import tyro

import bookkeeping
from bookkeeping import flat_args
import common
import grpo
import plot
from conftest import ROOT, TINY, read_metrics, script_args, tiny_args


def load(name, folder="study"):
    """A script of study/ (or benchmark/) as a module: they are run as files, not imported as a package."""
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


study = load("run")
warm_start = load("warm_start")


@pytest.mark.parametrize("scale", ["paper", "cpu"])
@pytest.mark.parametrize("experiment", list(study.EXPERIMENTS))
def test_every_study_command_passes_its_scripts_flag_checks(experiment, scale, tmp_path):
    if scale == "paper" and experiment in study.CPU_ONLY:
        pytest.skip("a CPU-scale experiment")
    args = script_args(study, experiment=experiment, scale=scale, root=str(tmp_path), dry_run=True)
    commands = study.run_commands(args, experiment)
    assert len(commands) == len(study.EXPERIMENTS[experiment][1]) >= 2
    for variant, cmd in commands:
        script = importlib.import_module(cmd[1].rsplit("/", 1)[-1][:-3])
        parsed = tyro.cli(script.Args, args=cmd[2:])
        script.check_args(parsed, 1)
        assert parsed.exp_name == variant and parsed.log.runs_dir == str(tmp_path / scale / experiment)
        if scale == "paper":
            assert parsed.model == "Qwen/Qwen2.5-1.5B-Instruct" and parsed.task.max_new_tokens == 1024
    # the variants differ in the flags the experiment is about, and only there
    parsed = [tyro.cli(importlib.import_module(c[1].rsplit("/", 1)[-1][:-3]).Args, args=c[2:]) for _, c in commands]
    assert len({repr({k: v for k, v in flat_args(p).items() if k != "exp_name"}) for p in parsed}) == len(parsed)


@pytest.mark.parametrize("scale", ["paper", "cpu"])
def test_group_size_compares_at_the_same_prompts_and_at_the_same_completions_per_step(scale, tmp_path):
    """Fig. 5 holds prompts per step; the issue also asks for G at G = 2's completions per step."""
    commands = study.run_commands(script_args(study, experiment="group-size", scale=scale, root=str(tmp_path),
                                              dry_run=True), "group-size")
    runs = {variant: tyro.cli(grpo.Args, args=cmd[2:]) for variant, cmd in commands}
    prompts = {v: a.prompts_per_step for v, a in runs.items()}
    completions = {v: a.prompts_per_step * a.group_size for v, a in runs.items()}
    assert prompts["G2"] == prompts["G4"] == prompts["G8"]
    assert completions["G2"] == completions["G4-same-completions"] == completions["G8-same-completions"]
    assert [runs[v].group_size for v in ("G4-same-completions", "G8-same-completions")] == [4, 8]


def test_the_harder_rungs_grpo_run_is_the_ladders_rung_3():
    """study/README promises that one run serves both (a link), so their commands must train the same."""
    args = script_args(study, experiment="all", root="/nonexistent", dry_run=True)
    (_, harder), = [c for c in study.run_commands(args, "harder-rung") if c[0] == "grpo"]
    (_, rung3), = [c for c in study.run_commands(args, "ladder") if c[0] == "rung3-2nums-plusminustimes"]
    assert study.training_flags(harder) == study.training_flags(rung3)


def test_a_stopped_study_skips_finished_runs_and_resumes_unfinished_ones(tiny_model_dir, tmp_path):
    out_dir = tmp_path / "cpu" / "group-size"
    grpo.train(tiny_args(grpo, model=tiny_model_dir, num_steps=2, test_size=2, save_every=1, runs_dir=str(out_dir),
                         exp_name="G2"))
    assert study.run_state(out_dir, "G2", 2)[0] == "finished"
    state, folder = study.run_state(out_dir, "G2", 3)
    assert state == "resumable" and folder.parent == out_dir
    assert study.run_state(out_dir, "G4", 2) == ("new", None)
    args = script_args(study, experiment="group-size", scale="cpu", root=str(tmp_path), steps=3)
    commands = dict(study.run_commands(args, "group-size"))
    assert commands["G2"][2:] == ["--resume", str(folder), "--num-steps", "3"]
    assert "--resume" not in commands["G4"]
    table = study.summary_table(study.variant_runs(out_dir)).splitlines()
    assert len(table) == 3 and table[2].startswith("| G2 | 1 | 2 | ")  # header, rule, the one run (1 seed, 2 steps)
    # a finished run is evaluated once more for the per-operator table, then never again
    (_, evaluate), = study.final_evaluations(args, "group-size")
    assert evaluate[2] == str(folder) and evaluate[evaluate.index("--details") + 1].endswith(study.FINAL_DETAILS)
    (folder / study.FINAL_EVAL).write_text("{}")
    assert study.final_evaluations(args, "group-size") == []
    # its checkpoints deleted (as a clone's committed runs have none), more steps are refused, even in a dry run:
    # the folder holds results, not an orphan to remove
    for checkpoint in folder.glob("checkpoint-*"):
        shutil.rmtree(checkpoint)
    for dry_run in (True, False):
        with pytest.raises(common.ConfigError, match=f"{folder} cannot be continued to step 3: it logged 2 steps"):
            study.run_commands(script_args(study, experiment="group-size", scale="cpu", root=str(tmp_path), steps=3,
                                           dry_run=dry_run), "group-size")
    assert [row["step"] for row in read_metrics(folder)[1]] == [0, 1, 2]


def test_an_orphan_variant_is_replaced_and_a_seed_is_a_run_of_its_own(tiny_model_dir, tmp_path):
    """A run stopped before its first checkpoint leaves a folder; the study removes it instead of starting a
    second folder beside it (the figure listed the variant twice); each seed is its own run."""
    out_dir = tmp_path / "cpu" / "group-size"
    orphan = out_dir / "G2__1__1700000000"
    orphan.mkdir(parents=True)
    (orphan / "args.json").write_text(json.dumps({"script": "grpo", "exp_name": "G2", "seed": 1}))
    (orphan / "metrics.jsonl").write_text(json.dumps({"step": 0, "charts/eval_accuracy": 0.5}) + "\n")
    (orphan / "samples.jsonl").touch()  # what the scripts' logger opens before the step-0 evaluation
    (orphan / bookkeeping.WANDB_RUN_ID).write_text("abc123\n")
    args = script_args(study, experiment="group-size", scale="cpu", root=str(tmp_path), seeds=(1, 2), only=("G2",))
    study.run_commands(script_args(study, experiment="group-size", scale="cpu", root=str(tmp_path), only=("G2",),
                                   dry_run=True), "group-size")
    assert orphan.exists()  # a dry run removes nothing
    commands = study.run_commands(args, "group-size")
    assert [label for label, _ in commands] == ["G2 seed 1", "G2 seed 2"] and not orphan.exists()
    # one that logged training steps but has no checkpoint (killed before its first, or its checkpoints deleted:
    # nothing tells which) is kept and refused, whatever its save_every
    for save_every in (0, 5, None):
        killed = out_dir / "G2__1__1700000001"
        killed.mkdir()
        (killed / "args.json").write_text(json.dumps({"num_steps": 20, "save_every": save_every}))
        (killed / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(4)))
        with pytest.raises(common.ConfigError, match=f"{killed} cannot be continued to step 60: it logged 3 steps"):
            study.run_commands(script_args(study, experiment="group-size", scale="cpu", root=str(tmp_path),
                                           only=("G2",)), "group-size")
        assert len(read_metrics(killed)[1]) == 4
        shutil.rmtree(killed)
    # no step logged, but more than a start left there (metrics a link, or an evaluation): kept and refused too
    for extra in ("metrics.jsonl", study.FINAL_EVAL):
        odd = out_dir / "G2__1__1700000002"
        odd.mkdir()
        (odd / "args.json").write_text(json.dumps({"num_steps": 20}))
        (tmp_path / "elsewhere.jsonl").write_text(json.dumps({"step": 0}) + "\n")
        (odd / extra).symlink_to(tmp_path / "elsewhere.jsonl")
        with pytest.raises(common.ConfigError, match=f"{odd} cannot be continued to step 60: it logged no step, "
                                                     f"but holds {extra} besides"):
            study.run_commands(args, "group-size")
        assert (odd / extra).is_symlink()
        shutil.rmtree(odd)
    assert [cmd[cmd.index("--seed") + 1] for _, cmd in commands] == ["1", "2"]


def test_a_run_another_experiment_made_is_linked_not_run_again(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """At CPU scale group-size's G2 is algorithms' grpo (the same flags and seed): the study links the finished run
    instead of computing the same updates again, and runs anew whatever differs in training or did not finish."""
    monkeypatch.setattr(study, "CPU", {**TINY, "model": tiny_model_dir, "num_steps": 2, "save_every": 1})
    monkeypatch.setattr(study, "CPU_SCRIPT", {"grpo": {}})

    def commands(experiment, root=tmp_path, **fields):
        return study.run_commands(script_args(study, experiment=experiment, root=str(root), **fields), experiment)

    (_, cmd), = commands("algorithms", only=("grpo",))
    earlier = Path(grpo.train(tyro.cli(grpo.Args, args=cmd[2:]))["run_dir"])  # the real run, as the study runs it
    metrics = (earlier / "metrics.jsonl").read_text()
    stopped = [line for line in metrics.splitlines(keepends=True) if json.loads(line)["step"] < 2]
    (earlier / "metrics.jsonl").write_text("".join(stopped))  # as if stopped after step 1
    assert [label for label, _ in commands("group-size", only=("G2",))] == ["G2"]
    (earlier / "metrics.jsonl").write_text(metrics)
    assert commands("group-size", only=("G2",), dry_run=True) == []
    assert not (tmp_path / "cpu" / "group-size").exists()  # a dry run links nothing
    assert commands("group-size", only=("G2",)) == []
    link, = (tmp_path / "cpu" / "group-size").glob("G2__1__*")
    assert link.is_symlink() and not Path(os.readlink(link)).is_absolute() and link.resolve() == earlier.resolve()
    assert f"{link.name} is the run {earlier}" in capsys.readouterr().err
    assert study.summary_table(study.variant_runs(link.parent)).splitlines()[2].startswith("| G2 | 1 | 2 | ")
    # the experiment that holds the run evaluates it, not one that links it (nor through the link, without its lock)
    assert study.final_evaluations(script_args(study, experiment="group-size", scale="cpu", root=str(tmp_path)),
                                   "group-size") == []
    assert len(study.final_evaluations(script_args(study, experiment="algorithms", scale="cpu", root=str(tmp_path)),
                                       "algorithms")) == 1
    assert commands("group-size", only=("G2",)) == []  # linked once; then finished
    # what changes training is run: another group size, another seed; so is a run that did not finish
    assert [label for label, _ in commands("group-size", only=("G4",))] == ["G4"]
    assert [label for label, _ in commands("kl", seeds=(2,), only=("beta-0.01",))] == ["beta-0.01 seed 2"]
    with pytest.raises(common.ConfigError, match=f"^{link} cannot be continued to step 3: it is a link to "
                                                 f".*{earlier.name}, which logged 2 steps; remove the link"):
        commands("group-size", only=("G2",), steps=3)
    assert [label for label, _ in commands("loss-aggregation", only=("sample-level",), steps=3)] == ["sample-level"]
    assert not (tmp_path / "cpu" / "loss-aggregation").exists()  # the study made no folder for it: it runs there
    pilot = tmp_path / "cpu" / "pilots" / earlier.name  # the same run outside the study's experiments
    shutil.copytree(earlier, pilot)
    saved = json.loads((earlier / "args.json").read_text())
    (earlier / "args.json").write_text(json.dumps({**saved, "learning_rate": 2e-3}))  # made with other flags
    assert [label for label, _ in commands("kl", only=("beta-0.01",))] == ["beta-0.01"]
    shutil.rmtree(pilot)
    (earlier / "args.json").write_text(json.dumps(saved))
    # the link is relative: a clone (here a moved folder) keeps it, and the summary reads through it
    shutil.move(tmp_path / "cpu", tmp_path / "clone")
    moved = tmp_path / "clone" / "group-size" / link.name
    assert study.run_state(moved.parent, "G2", 2) == ("finished", moved) and (moved / "metrics.jsonl").is_file()


def test_a_study_lock_that_is_a_link_is_refused_not_followed(tmp_path):
    out_dir = tmp_path / "cpu" / "group-size"
    out_dir.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("keep me")
    (out_dir / ".study.lock").symlink_to(elsewhere)
    with pytest.raises(common.ConfigError, match="--root=.*study.lock is a symbolic link"):
        study.study_lock(out_dir, str(tmp_path))
    assert elsewhere.read_text() == "keep me"
    (out_dir / ".study.lock").unlink()
    lock = study.study_lock(out_dir, str(tmp_path))  # checked: no link yet
    (out_dir / ".study.lock").symlink_to(elsewhere)  # one made between the check and the taking
    with pytest.raises(OSError) as err, lock:  # filelock >= 3.20.1 opens it with O_NOFOLLOW: refused, not truncated
        pass
    assert err.value.errno == errno.ELOOP, err.value  # not a timeout (filelock's Timeout is an OSError too)
    assert elsewhere.read_text() == "keep me"


def test_each_experiment_plots_a_png_for_the_readme_and_a_pdf_for_print(tmp_path, capsys):
    assert study.main(script_args(study, experiment="kl", root=str(tmp_path), dry_run=True)) == 0
    plots = [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("$ ") and "plot.py" in line]
    outs = [shlex.split(cmd)[shlex.split(cmd).index("--out") + 1] for cmd in plots]
    assert outs == [str(tmp_path / "cpu" / "kl") + suffix for suffix in (".png", ".pdf")]
    for cmd, out in zip(plots, outs):  # plot.py's own flags, as it parses them
        assert tyro.cli(plot.Args, args=shlex.split(cmd)[2:]).out == out


@pytest.mark.parametrize("experiment", sorted(study.FINDINGS))
def test_each_figure_has_the_default_panels_and_one_for_each_quantity_a_finding_reads(experiment, tmp_path, capsys):
    """Fig. 6(d) is the gradient norm, Fig. 3(b) the KL between the new and the old policy: neither is a default
    panel, and a verdict on a curve the figure does not draw cannot be checked by eye."""
    assert study.main(script_args(study, experiment=experiment, root=str(tmp_path), dry_run=True)) == 0
    plots = [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("$ ") and "plot.py" in line]
    read = {finding.metric for finding in study.FINDINGS[experiment]}
    for cmd in plots:
        metrics = tyro.cli(plot.Args, args=shlex.split(cmd)[2:]).metrics
        assert metrics[:len(plot.DEFAULT_METRICS)] == plot.DEFAULT_METRICS and read <= set(metrics)
        assert len(metrics) == len(set(metrics)) == len(set(plot.DEFAULT_METRICS) | read)
        assert all(metric in plot.TITLES and metric in plot.YLABELS for metric in metrics)


def test_unknown_variants_are_refused_for_all_experiments_too(tmp_path):
    for experiment in ("all", "group-size"):
        with pytest.raises(common.ConfigError, match="--only=.*not allowed"):
            study.main(script_args(study, experiment=experiment, root=str(tmp_path), only=("G3",), dry_run=True))


def test_the_summary_wall_time_is_the_logged_time_not_file_dates():
    rows = [{"step": 0, "time/eval": 30.0}, {"step": 1, "time/step": 50.0}, {"step": 2, "time/step": 40.0,
                                                                             "time/eval": 30.0}]
    assert study.wall_minutes(rows) == pytest.approx(150 / 60)
    hand_edited = rows + [{"step": 3, "time/step": float("nan"), "time/eval": float("inf")},
                          {"step": 4, "time/step": 60.0}]
    assert study.wall_minutes(hand_edited) == pytest.approx(210 / 60)


def readme_quick_start() -> str:
    """README.md's quick-start section, up to the next section."""
    return (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]


def test_the_readme_quick_start_is_the_studys_grpo_run():
    """The quick start's command is `python grpo.py` without flags; the results table's first row (checked
    below) shows that it trains what the CPU study's GRPO run trained, so its numbers are a newcomer's first run."""
    quick_start = readme_quick_start()
    assert re.findall(r"^python grpo\.py$", quick_start, flags=re.M) == ["python grpo.py"]


BOOKKEEPING_FLAGS = {"runs_dir", "micro_batch_size", "keep_checkpoints", "save_every", "log_samples_every"}


def quick_start_results():
    """The quick start's results table: (command, seeds, accuracy, best constant, gain, s per step, experiment,
    variant) per row."""
    quick_start = readme_quick_start()
    rows = re.findall(r"^\| `(python \w+\.py[^`]*)`[^|]* \| (\d+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| "
                      r"`([\w-]+)` ([\w.-]+) \|$", quick_start, flags=re.M)
    return [tuple(cell.strip() for cell in row) for row in rows]


@pytest.mark.parametrize("row", quick_start_results(), ids=lambda row: row[0])
def test_each_quick_start_result_is_the_study_run_it_names(row):
    """Each command in the quick start's table trains what its study run trained (its flags, the script's
    defaults), and the row's numbers recompute from that run's committed metrics.jsonl: the accuracy beside the best
    constant answer's on the same tasks and the gain over it, in points, of the mean and of the lowest seed."""
    command, seeds, accuracy, constant, gain, seconds, experiment, variant = row
    script_name, *flags = shlex.split(command)[1:]
    script = importlib.import_module(script_name[:-3])
    (_, cmd), *_ = study.run_commands(script_args(study, experiment=experiment, only=(variant,),
                                                  root="/nonexistent"), experiment)
    assert cmd[1].endswith(script_name)
    readme_run = flat_args(tyro.cli(script.Args, args=flags))
    study_run = flat_args(tyro.cli(script.Args, args=cmd[2:]))
    assert {k: v for k, v in readme_run.items() if k not in BOOKKEEPING_FLAGS | {"exp_name", "seed"}} == \
        {k: v for k, v in study_run.items() if k not in BOOKKEEPING_FLAGS | {"exp_name", "seed"}}

    runs = sorted((ROOT / "study" / "results" / "cpu" / experiment).glob(f"{variant}__*"))
    final, constants, step_seconds = [], set(), []
    for run in runs:
        _, rows = read_metrics(run)
        at_step_60 = [r for r in rows if r["step"] == 60 and "charts/eval_accuracy" in r]
        final += [r["charts/eval_accuracy"] for r in at_step_60]
        constants |= {r["charts/eval_best_constant"] for r in at_step_60}
        # the sentence under the table: every run starts from the same warm start's 49.2% (63 of 128)
        assert [r["charts/eval_accuracy"] for r in rows if r["step"] == 0 and "charts/eval_accuracy" in r] == [63 / 128]
        step_seconds.append(round(statistics.median(r["time/step"] for r in rows if "time/step" in r)))
    assert len(final) == len(runs) == int(seeds)
    pct = study.percent  # rounded as the study's tables round, half up: 104/128 is 81.3%
    spread = "one seed so far" if len(final) == 1 else f"{pct(min(final))[:-1]}-{pct(max(final))}"
    assert accuracy == f"{pct(sum(final) / len(final))} ({spread})"
    (best_constant,) = constants  # every seed evaluates the same held-out tasks
    assert constant == pct(best_constant)
    mean_gain, lowest_gain = (points(Fraction(sum(map(Fraction, final)), len(final)) - Fraction(best_constant)),
                              points(Fraction(min(final)) - Fraction(best_constant)))
    assert gain == (mean_gain if len(final) == 1 else f"{mean_gain} ({lowest_gain})")
    step_seconds.sort()
    assert seconds == (", ".join(map(str, step_seconds)) if len(runs) <= 2 else f"{step_seconds[0]}-{step_seconds[-1]}")


def points(gain: Fraction) -> str:
    """A gain in accuracy as signed points, rounded half up as study.percent rounds: 3/256 is +1.2."""
    exact = decimal.Decimal(gain.numerator) / decimal.Decimal(gain.denominator) * 100
    return f"{exact.quantize(decimal.Decimal('0.1'), rounding=decimal.ROUND_HALF_UP):+}"


def test_the_quick_start_results_table_is_read_whole():
    """Every row of the table is checked above (none is skipped by a pattern that failed to match it), and the
    first is the quick start's own command."""
    quick_start = readme_quick_start()
    rows = quick_start_results()
    assert len(rows) == len(re.findall(r"^\| `python ", quick_start, flags=re.M)) >= 9
    assert [row[6:] for row in rows[:3]] == [("algorithms", "grpo"), ("algorithms", "ppo"), ("algorithms", "dapo")]


def prose_blocks(markdown: str) -> list[str]:
    """The bullets and paragraphs of a markdown text, without its tables, headings and code blocks."""
    blocks, current, in_code = [], [], False
    for line in markdown.split("\n"):
        if line.startswith("```"):
            in_code = not in_code
        if in_code or line.startswith(("```", "|", "#", "- ")) or not line.strip():
            if current:
                blocks.append("\n".join(current))
            current = [line] if line.startswith("- ") and not in_code else []
            continue
        current.append(line)
    return blocks + ["\n".join(current)] if current else blocks


OPERATOR = re.compile(r"`(?:[-+*/]|\*\*)`")
COUNT = re.compile(r"\b\d+(?:-\d+)? of (?:the |its )?\d+\b|\ball \d+\b")
LOGGED = re.compile(r"logged\s+(?:training\s+)?completions")


@pytest.mark.parametrize("readme, counted_at_least", [("README.md", 1), ("study/README.md", 40)])
def test_every_count_of_answers_or_samples_cites_the_committed_file_it_comes_from(readme, counted_at_least):
    """A count of answers by operator names the file it was counted in (`final_eval.jsonl`, an evaluation's
    `*_details.jsonl`...), and a count of logged training completions names `samples.jsonl`, in the same bullet
    or paragraph: a reader can recount it from the clone."""
    counting = [b for b in prose_blocks((ROOT / readme).read_text()) if COUNT.search(b)]
    by_operator = [b for b in counting if OPERATOR.search(b)]
    uncited = [b for b in by_operator if not re.search(r"\.jsonl?\b", b)]
    uncited += [b for b in counting if LOGGED.search(b) and "samples.jsonl" not in b]
    assert not uncited, "\n\n".join(b[:200] for b in uncited)
    assert len(by_operator) >= counted_at_least  # the patterns match


def test_the_operator_table_reads_each_runs_final_evaluation(tmp_path):
    run = tmp_path / "grpo__1__1700000000"
    run.mkdir()
    record = {"greedy_accuracy": 0.75, "by_operator_class": {
        "+": {"tasks": 2, "accuracy": 1.0, "chosen": {"+": 2}},
        "-": {"tasks": 2, "accuracy": 0.5, "chosen": {"+": 1, "-": 1}}}}
    (run / study.FINAL_EVAL).write_text(json.dumps(record) + "\n")
    lines = study.operator_table(tmp_path).splitlines()
    # the two classes' tables are mirror images of each other: every table with these margins is as extreme
    assert lines[2:] == ["| grpo__1__1700000000 | `+` | 2 | 1.000 |  | `+` 2 | 1 |",
                         "| grpo__1__1700000000 | `-` | 2 | 0.500 |  | `+` 1, `-` 1 |  |"]
    # an evaluation that predates per-class baselines gets them from its details: each task once, by class
    rows = [{"nums": [4, 3], "target": 7, "operator_class": "+"}, {"nums": [7, 5], "target": 12, "operator_class": "+"},
            {"nums": [4, 3], "target": 1, "operator_class": "-"}, {"nums": [9, 2], "target": 7, "operator_class": "-"}]
    rows = [{**row, "correct": True, "chosen_operators": row["operator_class"]} for row in rows]  # evaluate's fields
    (run / study.FINAL_DETAILS).write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [line.split(" | ")[4] for line in study.operator_table(tmp_path).splitlines()[2:]] == ["0.250", "0.125"]
    record["by_operator_class"]["+"]["uniform_guess"] = 0.3  # evaluate.py's own record comes first
    (run / study.FINAL_EVAL).write_text(json.dumps(record) + "\n")
    assert [line.split(" | ")[4] for line in study.operator_table(tmp_path).splitlines()[2:]] == ["0.300", "0.125"]
    record["by_operator_class"]["-"]["chosen"] = {"": 2}  # a well-formed answer without an operator: a lone number
    (run / study.FINAL_EVAL).write_text(json.dumps(record) + "\n")
    assert study.operator_table(tmp_path).splitlines()[3].split(" | ")[5] == "no operator 2"
    record["by_operator_class"]["-"]["chosen"] = {"none": 1, "-": 1}  # evaluate's code for no well-formed answer
    (run / study.FINAL_EVAL).write_text(json.dumps(record) + "\n")
    assert study.operator_table(tmp_path).splitlines()[3].split(" | ")[5] == "no answer 1, `-` 1"


def fisher_two_sided(star_on_products: int, star_on_sums: int, per_class: int = 64) -> float:
    """Fisher's exact two-sided test of a 2 x 2 table, written out: the tables as likely as the observed or less."""
    total = star_on_products + star_on_sums
    def prob(k):
        if not (0 <= k <= per_class and 0 <= total - k <= per_class):
            return 0.0
        return math.comb(per_class, k) * math.comb(per_class, total - k) / math.comb(2 * per_class, total)
    return sum(prob(k) for k in range(total + 1) if prob(k) <= prob(star_on_products) * (1 + 1e-9))


@pytest.mark.parametrize("star_on_products, star_on_sums", [(15, 9), (27, 15), (42, 18), (58, 4)])
def test_two_classes_of_equal_size_get_fishers_exact_test(star_on_products, star_on_sums):
    by_class = {"*": {"tasks": 64, "chosen": {"*": star_on_products, "+": 64 - star_on_products}},
                "+": {"tasks": 64, "chosen": {"*": star_on_sums, "+": 64 - star_on_sums}}}
    assert study.independence_p(by_class) == pytest.approx(fisher_two_sided(star_on_products, star_on_sums),
                                                           rel=1e-9)


def test_the_shuffled_estimate_agrees_with_the_exact_sum_on_unequal_classes():
    """Unequal classes and three answers, where the chi-square's weights decide which tables count as extreme:
    the random shuffles (any number of classes) and the exact sum (two classes) are two separate computations."""
    by_class = {"+": {"tasks": 28, "chosen": {"+": 20, "*": 5, "none": 3}},
                "*": {"tasks": 19, "chosen": {"+": 8, "*": 10, "none": 1}}}
    exact = study.independence_p(by_class, exact=True)
    estimate = study.independence_p(by_class, exact=False)
    assert 0.01 < exact < 0.2  # a p the shuffles can resolve
    assert abs(estimate - exact) <= 4 * math.sqrt(exact * (1 - exact) / 9999), (estimate, exact)


def test_a_choice_that_ignores_the_right_operator_is_not_called_dependent():
    same = {"*": 30, "+": 30, "-": 4}
    by_class = {cls: {"tasks": 64, "chosen": dict(same)} for cls in "+-*"}
    assert study.independence_p(by_class) == 1.0  # the least chi-square there is: every shuffle reaches it
    follows = {cls: {"tasks": 64, "chosen": {cls: 60, "+" if cls != "+" else "*": 4}} for cls in "+-*"}
    assert study.independence_p(follows) == 1 / 10000  # no shuffle of 192 tasks comes close: the floor
    assert study.independence_p({"+": {"tasks": 64, "chosen": {"+": 64}}}) == 1.0  # one class: nothing to test
    assert study.independence_p({"+": {"tasks": 64, "chosen": {"+": 64}},
                                 "*": {"tasks": 64, "chosen": {"+": 64}}}) == 1.0  # one answer everywhere


def fake_run(out_dir, variant, seed, value, metric="charts/eval_accuracy", num_steps=10, last_step=10):
    """A run folder as the scripts leave it, without a model: args.json and two metrics rows, the metric at
    step 0 (0.0, which the verdict must not read) and at `last_step`."""
    folder = out_dir / f"{variant}__{seed}__1700000000"
    folder.mkdir(parents=True)
    (folder / "args.json").write_text(json.dumps({"num_steps": num_steps}))
    rows = [{"step": 0, metric: 0.0},
            {"step": last_step, "charts/response_length": 30.0, "time/step": 1.0, metric: value}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_tables_list_a_sweeps_variants_in_its_order_not_by_name(tmp_path):
    """By name, "beta-0.0__" sorts after "beta-0.04__" ("_" after digits); the tables follow EXPERIMENTS' order
    (beta 0, 0.0075, 0.01, 0.04), a variant the experiment does not list last; the per-operator table too."""
    out_dir = tmp_path / "kl"
    for variant in ("beta-0.04", "beta-0.0", "extra", "beta-0.01", "beta-0.0075"):
        fake_run(out_dir, variant, 1, 0.5)
        (out_dir / f"{variant}__1__1700000000" / study.FINAL_EVAL).write_text(json.dumps(
            {"by_operator_class": {"+": {"tasks": 1, "accuracy": 1.0, "chosen": {"+": 1}}}}) + "\n")
    expected = ["beta-0.0", "beta-0.0075", "beta-0.01", "beta-0.04", "extra"]
    assert [row.split(" | ")[0][2:] for row in study.summary_table(study.variant_runs(out_dir)).splitlines()[2:]] \
        == expected
    assert [row.split(" | ")[0][2:].split("__")[0] for row in study.operator_table(out_dir).splitlines()[2:]] \
        == expected


def test_the_summary_gives_the_share_of_groups_that_carried_no_gradient(tmp_path):
    """GRPO and DAPO log each step's share of groups with equal rewards; the summary gives its mean over every
    step of every seed (0.25 and 0.75 in seed 1, 1.0 in seed 2: 2/3), and "-" for PPO, which has no groups."""
    for variant, seed, shares in (("grpo", 1, (0.25, 0.75)), ("grpo", 2, (1.0,)), ("ppo", 1, ())):
        fake_run(tmp_path, variant, seed, 0.5)
        rows = [{"step": step, "time/step": 1.0, "charts/response_length": 30.0, "charts/zero_std_fraction": share}
                for step, share in enumerate(shares, start=11)]
        with open(tmp_path / f"{variant}__{seed}__1700000000" / "metrics.jsonl", "a") as metrics:
            metrics.writelines(json.dumps(row) + "\n" for row in rows)
    header, _, grpo_row, ppo_row = study.summary_table(study.variant_runs(tmp_path)).splitlines()
    column = header.split(" | ").index("equal-reward groups")
    assert grpo_row.split(" | ")[column] == "0.667" and ppo_row.split(" | ")[column] == "-"


def test_the_summarys_step_time_is_the_median_of_every_seeds_steps(tmp_path):
    """An even count of steps has two middle values: the median is their mean (96.35 and 96.61 s: 96, not the
    upper one's 97), over the steps of every seed together."""
    for seed, (first, second) in ((1, (96.35, 200.0)), (2, (96.61, 10.0))):
        fake_run(tmp_path, "ds", seed, 0.9, num_steps=2, last_step=2)
        rows = [{"step": 0, "charts/eval_accuracy": 0.5},
                {"step": 1, "time/step": first, "charts/response_length": 30.0},
                {"step": 2, "time/step": second, "charts/response_length": 30.0, "charts/eval_accuracy": 0.9}]
        (tmp_path / f"ds__{seed}__1700000000" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    header, _, row = study.summary_table(study.variant_runs(tmp_path)).splitlines()
    assert row.split(" | ")[header.split(" | ").index("s/step")] == "96"


def test_the_summarys_entropy_is_the_last_updates_when_dynamic_sampling_skipped_the_last_step(tmp_path):
    """A DAPO step whose generation batches held no informative group makes no update and logs no losses: the
    entropy at the end is that of the last update (0.02 at step 59), per seed (0.04 in seed 2: mean 0.03)."""
    for seed, entropy in ((1, 0.02), (2, 0.04)):
        fake_run(tmp_path, "ds", seed, 0.9, num_steps=60, last_step=60)
        rows = [{"step": 0, "charts/eval_accuracy": 0.5},
                {"step": 59, "time/step": 1.0, "charts/response_length": 30.0, "losses/entropy": entropy},
                {"step": 60, "time/step": 1.0, "charts/response_length": 30.0, "charts/eval_accuracy": 0.9}]
        (tmp_path / f"ds__{seed}__1700000000" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    header, _, row = study.summary_table(study.variant_runs(tmp_path)).splitlines()
    assert row.split(" | ")[header.split(" | ").index("entropy at the end")] == "0.030"


def test_the_summary_gives_each_runs_accuracy_per_step_above_its_baselines(tmp_path):
    """One row per run, then one row per baseline value naming the variants evaluated on those tasks."""
    for variant, seed, constant in (("grpo", 1, 0.5), ("grpo", 2, 0.5), ("rung1", 1, 1.0)):
        folder = tmp_path / f"{variant}__{seed}__1700000000"
        folder.mkdir()
        rows = [{"step": 0, "charts/eval_accuracy": 0.25 * seed, "charts/eval_best_constant": constant,
                 "charts/eval_uniform_guess": 0.25}, {"step": 10, "charts/eval_accuracy": 0.75}]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:1 + (seed == 1)]))
    assert study.eval_step_table(study.variant_runs(tmp_path), per_seed=True).splitlines()[2:] == [
        "| grpo, seed 1 | 25.0% | 75.0% |", "| grpo, seed 2 | 50.0% |  |", "| rung1, seed 1 | 25.0% | 75.0% |",
        "| best constant answer (grpo) | 50.0% | |", "| best constant answer (rung1) | 100.0% | |",
        "| uniform guess (grpo, rung1) | 25.0% | |"]


def test_the_summary_gives_each_evaluation_steps_mean_and_range_over_seeds(tmp_path):
    fake_run(tmp_path, "grpo", 1, 0.6)
    fake_run(tmp_path, "grpo", 2, 0.7)
    fake_run(tmp_path, "grpo", 3, 0.5, last_step=5)  # stopped early: counts at step 5 only
    fake_run(tmp_path, "ppo", 1, 0.8)
    assert study.eval_step_table(study.variant_runs(tmp_path)).splitlines() == [
        "| run | step 0 | step 5 | step 10 |", "|---|---|---|---|",
        "| grpo | 0.0% (0.0%-0.0%, n=3) | 50.0% (50.0%-50.0%, n=1) | 65.0% (60.0%-70.0%, n=2) |",
        "| ppo | 0.0% |  | 80.0% |"]
    assert study.eval_step_table(study.variant_runs(tmp_path / "none")) == ""
    assert study.percent(72 / 128) == "56.3%" and study.percent(0.546875) == "54.7%"
    assert study.percent(201 / 400) == "50.3%"  # 0.5025 * 1000 is 502.49999... in floats


def verdict_row(out_dir, experiment, finding):
    table = study.verdict_table(study.variant_runs(out_dir), experiment)
    (row,) = [line for line in table.splitlines() if line.startswith(f"| {finding.claim} |")]
    return row


@pytest.mark.parametrize("higher, lower, verdict, p", [
    ((0.8, 0.7), (0.6, 0.5), "held", "0.33"),  # 2 of the 6 ways to deal 4 seeds into 2 + 2 separate them this far
    ((0.4, 0.5), (0.6, 0.7), "opposite", "0.33"),
    ((0.8, 0.55), (0.6, 0.5), "not separable at this scale", "0.67"),
    ((0.7, 0.6), (0.6, 0.5), "not separable at this scale", "0.67"),  # a tie is no win
    ((0.8, 0.7), (0.5,), "needs >= 2 seeds per side", "-"),
])
def test_a_finding_holds_only_when_every_seed_of_one_side_beats_every_seed_of_the_other(higher, lower, verdict, p,
                                                                                          tmp_path):
    finding = study.FINDINGS["group-size"][0]
    for variant, values in ((finding.higher, higher), (finding.lower, lower)):
        for seed, value in enumerate(values, 1):
            fake_run(tmp_path, variant, seed, value, finding.metric)
    row = verdict_row(tmp_path, "group-size", finding)
    assert row.endswith(f"| {p} | {verdict} |")
    assert f"| {sum(higher) / len(higher) - sum(lower) / len(lower):+.4g} | {p} |" in row
    assert f"`{finding.higher}` {sum(higher) / len(higher):.4g} ({min(higher):.4g}-{max(higher):.4g}, " \
           f"n={len(higher)})" in row


def test_the_permutation_p_counts_every_split_of_the_seeds_at_least_as_far_apart_either_way():
    """Three seeds against three that do not overlap cannot go below 0.1 (the mirror split is as far apart),
    two against three not below 0.1: the table says how little a clean separation of so few seeds shows. An
    overlapping case, worked by hand over the 10 ways to pick 2 of 5 seeds: {0.9, 0.6} against {0.5, 0.7, 0.4}
    differ by 0.2167; {0.9, 0.7} (0.3) and {0.5, 0.4} (0.2833) are as far."""
    assert study.permutation_p([0.9, 0.8, 0.7], [0.1, 0.2, 0.3]) == pytest.approx(2 / 20)
    assert study.permutation_p([0.1, 0.2], [0.7, 0.8, 0.9]) == pytest.approx(1 / 10)  # {0.8, 0.9}: 0.52 apart, not 0.65
    assert study.permutation_p([0.1, 0.2], [0.3, 0.4, 0.5]) == pytest.approx(2 / 10)  # {0.4, 0.5}: 0.25 apart too
    assert study.permutation_p([0.9, 0.6], [0.5, 0.7, 0.4]) == pytest.approx(3 / 10)
    assert study.permutation_p([0.6, 0.9], [0.4, 0.5, 0.7]) == pytest.approx(3 / 10)  # seed order does not matter
    assert study.permutation_p([0.5, 0.5], [0.5, 0.5, 0.5]) == 1.0  # every split ties: nothing separates them
    # {0.6, 0.4} and {0.2, 0.8} differ from the rest by the same 0.1, but not in floats: a tie still counts
    assert study.permutation_p([0.2, 0.8], [0.6, 0.4, 0.2]) == pytest.approx(8 / 10)


def test_an_unfinished_run_is_not_a_seed_of_the_verdict(tmp_path):
    finding = next(f for f in study.FINDINGS["group-size"] if f.metric == "losses/kl_ref")  # a training metric
    fake_run(tmp_path, finding.higher, 1, 0.8, finding.metric)
    fake_run(tmp_path, finding.higher, 2, 0.7, finding.metric)
    fake_run(tmp_path, finding.higher, 3, 0.1, finding.metric, last_step=9)  # stopped one step short
    fake_run(tmp_path, finding.lower, 1, 0.6, finding.metric)
    fake_run(tmp_path, finding.lower, 2, 0.5, finding.metric, num_steps=20)  # resumed to 20 steps, stopped at 10
    row = verdict_row(tmp_path, "group-size", finding)
    assert "(0.7-0.8, n=2)" in row and "(0.6-0.6, n=1)" in row and row.endswith("| needs >= 2 seeds per side |")
    fake_run(tmp_path, finding.lower, 3, 0.5, finding.metric)
    assert verdict_row(tmp_path, "group-size", finding).endswith("| held |")


def test_every_finding_compares_two_variants_of_its_experiment_on_a_metric_their_scripts_log():
    """A renamed variant or metric would leave its finding without runs for ever, reading as too few seeds."""
    assert set(study.FINDINGS) == set(study.EXPERIMENTS) - study.CPU_ONLY
    for experiment, findings in study.FINDINGS.items():
        scripts = {variant: script for variant, script, _ in study.EXPERIMENTS[experiment][1]}
        for finding in findings:
            assert finding.higher != finding.lower and {finding.higher, finding.lower} <= set(scripts), finding
            for variant in (finding.higher, finding.lower):
                logged = (ROOT / f"{scripts[variant]}.py").read_text() + (ROOT / "common.py").read_text()
                assert f'"{finding.metric}"' in logged, (finding, scripts[variant])
                if finding.metric == "losses/kl_ref":  # without a reference model the scripts log none
                    changes = dict((v, c) for v, _, c in study.EXPERIMENTS[experiment][1])[variant]
                    flags = {**study.CPU_SCRIPT[scripts[variant]], **changes}
                    assert flags.get("beta", 0.0) > 0, finding


def test_a_training_quantity_is_read_as_its_last_steps_mean_an_evaluation_as_its_last_value(tmp_path):
    folder = tmp_path / "x" / "G2__1__1700000000"
    folder.mkdir(parents=True)
    (folder / "args.json").write_text(json.dumps({"num_steps": 20}))
    rows = [{"step": 0, "charts/eval_accuracy": 0.1}] + [{"step": s, "losses/kl_ref": float(s)} for s in range(1, 21)]
    rows.append({"step": 20, "charts/eval_accuracy": 0.7})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    runs = study.variant_runs(tmp_path / "x")["G2"]
    assert study.finished_values(runs, "losses/kl_ref") == [sum(range(11, 21)) / study.TAIL]
    assert study.finished_values(runs, "charts/eval_accuracy") == [0.7]


@pytest.mark.parametrize("experiment", sorted(study.FINDINGS))
def test_study_readme_prints_each_experiments_verdicts_as_its_committed_runs_give_them(experiment):
    """A run recorded without re-printing its experiment's findings table would leave a stale verdict in the
    study's README: each section holds the table `--summary` prints from the committed metrics."""
    section = (ROOT / "study" / "README.md").read_text().split(f"\n### `{experiment}`", 1)[1].split("\n### ", 1)[0]
    table = study.verdict_table(study.variant_runs(ROOT / "study" / "results" / "cpu" / experiment), experiment)
    assert table in section


def test_the_summary_ends_with_the_verdicts_where_the_paper_has_findings(tmp_path, capsys):
    for seed in (1, 2):
        fake_run(tmp_path / "cpu" / "group-size", "G8", seed, 0.8)
        fake_run(tmp_path / "cpu" / "group-size", "G2", seed, 0.5)
    assert study.main(script_args(study, experiment="group-size", root=str(tmp_path), summary=True)) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith(verdict_row(tmp_path / "cpu" / "group-size", "group-size",
                                                 study.FINDINGS["group-size"][-1]))
    assert f"{study.FINDINGS['group-size'][0].claim} | `charts/eval_accuracy` | `G8` 0.8 (0.8-0.8, n=2)" in printed
    assert study.main(script_args(study, experiment="ladder", root=str(tmp_path), summary=True)) == 0
    assert "paper's finding" not in capsys.readouterr().out


def test_each_rungs_baselines_are_scored_on_the_tasks_its_runs_evaluate_and_committed(capsys):
    """Rung 1 is solved by a constant; the CPU rung's split is half sums, half products, so no constant passes
    50%; rung 4's three operator patterns cap it near a third. The committed table is this command's output."""
    rungs = ("rung1-2nums-plus", "rung2-2nums-plustimes", "rung4-3nums-plusminus")
    assert study.main(script_args(study, experiment="ladder", baselines=True, only=rungs)) == 0
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["ladder/rung1-2nums-plus"][2:4] == ["`+` 128", "100.0% (`n1 + n2`)"]
    assert rows["ladder/rung2-2nums-plustimes"][1:4] == ["128", "`*` 64, `+` 64", "50.0% (`n1 + n2`)"]
    assert rows["ladder/rung4-3nums-plusminus"][2] == "`++` 43, `+-` 43, `--` 42"
    assert rows["ladder/rung1-2nums-plus"][0] == plot.rung_name(dict(task_min_numbers=2, task_max_numbers=2,
                                                                     task_max_value=20, task_operators="+"))
    table = (ROOT / "study" / "results" / "cpu" / "baselines.md").read_text().splitlines()
    # rung 5's best constant is one template per number count: its | must not split the markdown cell
    cells = [len(re.split(r"(?<!\\)\|", line)) for line in table]
    assert "\\|" in table[-1] and cells == [cells[0]] * len(table), cells
    committed = [line.split(" | ")[1:] for line in table[2:]]
    for row in rows.values():
        assert row in committed


def test_baselines_are_refused_at_the_papers_scale():
    with pytest.raises(common.ConfigError, match="--scale='paper' is not allowed"):
        study.main(script_args(study, experiment="kl", scale="paper", baselines=True))


def paired_run(folder: Path, seed, rewards: list[float], surrogates: list[float], completions: list[str],
               longer_at: int = 0):
    folder.mkdir(parents=True)
    (folder / "args.json").write_text(json.dumps({} if seed is None else {"seed": seed}))
    rows = [{"step": 0, "charts/eval_accuracy": 0.5}]
    rows += [{"step": s, "charts/reward": r, "charts/response_length": 30.0 + (s == longer_at),
              "losses/surrogate": v, "losses/clipfrac": 0.001} for s, (r, v) in enumerate(zip(rewards, surrogates), 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 3, "charts/')
    (folder / "samples.jsonl").write_text("".join(json.dumps({"step": 1, "prompt": "p", "completion": c}) + "\n"
                                                  for c in completions))
    return folder


def test_a_pair_of_one_seed_is_compared_step_by_step_and_runs_of_two_seeds_are_refused(tmp_path):
    """The entropy section's paired comparison: same reward, completions alike (of the first run's, the second's
    count named when it differs), each quantity's change relative to the second's magnitude (a negative surrogate
    that rose reads +), exactly equal ones as 0, a step only one run logged, a torn last line skipped; two seeds,
    a folder without a seed and a metric neither run logged are refused in one line."""
    paired = load("paired")
    first = paired_run(tmp_path / "a", 1, [0.5, 0.25, 0.5, 0.5], [-0.2, 0.2, 0.1, 0.1], ["x", "y", "z"], longer_at=3)
    second = paired_run(tmp_path / "b", 1, [0.5, 0.3, 0.5], [-0.25, 0.2, 0.1], ["x", "y", "w", "v"])
    table = paired.paired_table(first, second, ["losses/surrogate", "losses/clipfrac"], steps=5).splitlines()
    assert table[2:] == ["| 1 | yes | 2 of 3 (4 in the second) | +20.00% | 0 |", "| 2 | no | - | 0 | 0 |",
                         "| 3 | no | - | 0 | 0 |",  # the same reward, not the same length: other completions
                         "| 4 | only the first run | - | - | - |"]
    other = paired_run(tmp_path / "c", 2, [0.5], [0.1], ["x"])
    with pytest.raises(common.ConfigError, match=r"runs=.*a'.*c'.*seeds are 1 and 2; a pair is two runs of one"):
        paired.paired_table(first, other, ["losses/surrogate"], steps=5)
    no_seed = paired_run(tmp_path / "d", None, [0.5], [0.1], ["x"])
    with pytest.raises(common.ConfigError, match=r"runs=.*d'.*records no seed"):
        paired.paired_table(first, no_seed, ["losses/surrogate"], steps=5)
    with pytest.raises(common.ConfigError, match=r"--metrics=\['losses/kl'\] is not allowed"):
        paired.paired_table(first, second, ["losses/kl"], steps=5)
    assert paired.relative(math.nan, 0.5) == "nan"  # a skipped update's gradient norm is no change
