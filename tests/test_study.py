"""study/: every command of the paper's study is a valid configuration, and a stopped study resumes."""

import importlib
import importlib.util
import sys

import pytest
import tyro

import grpo
from conftest import ROOT


def load(name):
    spec = importlib.util.spec_from_file_location(f"study_{name}", ROOT / "study" / f"{name}.py")
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
    args = study.Args(experiment=experiment, scale=scale, root=str(tmp_path), dry_run=True)
    commands = study.run_commands(args, experiment)
    assert len(commands) == len(study.EXPERIMENTS[experiment][1]) >= 2
    for variant, cmd in commands:
        script = importlib.import_module(cmd[1].rsplit("/", 1)[-1][:-3])
        parsed = tyro.cli(script.Args, args=cmd[2:])
        script.check_args(parsed, 1)
        assert parsed.exp_name == variant and parsed.runs_dir == str(tmp_path / scale / experiment)
        if scale == "paper":
            assert parsed.model == "Qwen/Qwen2.5-1.5B-Instruct" and parsed.max_new_tokens == 1024
    # the variants differ in the flags the experiment is about, and only there
    parsed = [tyro.cli(importlib.import_module(c[1].rsplit("/", 1)[-1][:-3]).Args, args=c[2:]) for _, c in commands]
    assert len({repr({k: v for k, v in vars(p).items() if k != "exp_name"}) for p in parsed}) == len(parsed)


def test_a_stopped_study_skips_finished_runs_and_resumes_unfinished_ones(tiny_model_dir, tmp_path):
    out_dir = tmp_path / "cpu" / "group-size"
    grpo.train(grpo.Args(model=tiny_model_dir, num_steps=2, prompts_per_step=2, group_size=2, max_new_tokens=4,
                         eval_size=1, test_size=2, save_every=1, runs_dir=str(out_dir), exp_name="G2",
                         num_minibatches=1))
    assert study.run_state(out_dir, "G2", 2)[0] == "finished"
    state, folder = study.run_state(out_dir, "G2", 3)
    assert state == "resumable" and folder.parent == out_dir
    assert study.run_state(out_dir, "G4", 2) == ("new", None)
    args = study.Args(experiment="group-size", scale="cpu", root=str(tmp_path), steps=3)
    commands = dict(study.run_commands(args, "group-size"))
    assert commands["G2"][2:] == ["--resume", str(folder), "--num-steps", "3"]
    assert "--resume" not in commands["G4"]
    table = study.summary_table(out_dir).splitlines()
    assert len(table) == 3 and table[2].startswith("| G2 | 2 | ")  # header, rule, the one run


def test_the_warm_start_never_shows_a_correct_answer():
    import countdown_reward

    examples = warm_start.examples(warm_start.Args(), 200)
    assert len(examples) == 200
    for ex in examples:
        text = ex["completion"]
        assert countdown_reward.is_well_formed(text), text
        assert not countdown_reward.is_correct(text, ex["nums"], ex["target"]), text


def test_the_readme_quick_start_trains_even_beside_the_committed_results():
    """The quick start's study command, in this repository as cloned (whose committed runs count as
    finished under study/results): it must still launch a GRPO run, not skip it."""
    import re
    import shlex
    import subprocess

    quick_start = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    (command,) = re.findall(r"^python study/run\.py .*$", quick_start, flags=re.M)
    result = subprocess.run([sys.executable, *shlex.split(command)[1:], "--dry-run"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"^\$ python grpo\.py .*--num-steps 20", result.stdout, flags=re.M), result.stdout
