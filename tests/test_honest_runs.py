"""Runs that cannot lie: resume honours what was typed, one writer per run folder, one history per run,
inputs checked before anything loads, nothing executed from a checkpoint, no work lost to a full disk."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bookkeeping

import common
import dapo
import grpo
import ppo
from conftest import ROOT, even_token_reward, read_metrics, script_args, tiny_args
from conftest import run_script as cli


@pytest.fixture
def finished_run(tiny_model_dir, tmp_path) -> str:
    """A finished 2-step GRPO run with a checkpoint after each step."""
    args = tiny_args(grpo, model=tiny_model_dir, runs_dir=str(tmp_path / "runs"), num_steps=2, save_every=1,
                     keep_checkpoints=0)
    return grpo.train(args, reward_fn=even_token_reward)["run_dir"]


# ---- 1. Resume compares what was typed, not values against the defaults --------------------------------
def test_typed_flags_are_read_from_the_command_line():
    assert bookkeeping.typed_flags(["--num-steps", "200", "--learning-rate=1e-6", "--no-dynamic-sampling"]) == {
        "num_steps", "learning_rate", "no_dynamic_sampling", "dynamic_sampling"}


def test_a_flag_typed_at_its_default_value_still_counts(finished_run):
    run_args = json.loads(Path(finished_run, "args.json").read_text())
    assert run_args["learning_rate"] == 1e-3 and script_args(grpo).learning_rate == 1e-5
    result = cli(["grpo.py", "--resume", finished_run, "--num-steps", "3", "--learning-rate", "1e-5"])
    assert result.returncode == 2
    assert "--learning-rate=1e-05 is not allowed with --resume: the run was started with 0.001" in result.stderr
    # --num-steps at its default (60) extends the run: it is what the user typed
    extended, _, _ = bookkeeping.resume_args(script_args(grpo, resume=finished_run), script_args(grpo), finished_run,
                                             "grpo",
                                        {"num_steps"})
    assert extended.num_steps == 60 and extended.learning_rate == 1e-3


def test_resuming_a_finished_run_says_so_and_changes_nothing(finished_run):
    before = Path(finished_run, "args.json").read_text()
    for extra in ([], ["--num-steps", "2"], ["--num-steps", "1"]):
        result = cli(["grpo.py", "--resume", finished_run, *extra])
        assert result.returncode == 2 and "raise --num-steps to continue it" in result.stderr, result.stderr
    assert Path(finished_run, "args.json").read_text() == before


# ---- 2. One writer per run folder -------------------------------------------------------------------
def test_runs_started_in_the_same_second_get_their_own_folders_and_a_second_writer_is_refused(tmp_path):
    d = common.Dist()
    first = bookkeeping.RunDir(str(tmp_path), "x", 1, None, d)
    second = bookkeeping.RunDir(str(tmp_path), "x", 1, None, d)
    a, b = first.create(), second.create()
    assert a != b and os.path.isdir(a) and os.path.isdir(b)
    with pytest.raises(common.ConfigError, match=f"the run folder is in use by process {os.getpid()}"):
        bookkeeping.RunDir(str(tmp_path), "x", 1, Path(a) / "checkpoint-1", d)


def test_a_lock_dies_with_its_process(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c",
                               "import bookkeeping, common, time; run = bookkeeping.RunDir(%r, 'x', 1, None, "
                               "common.Dist()); run.create(); print('ok', flush=True); time.sleep(60)" % str(tmp_path)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ok"
    (folder,) = os.listdir(tmp_path)
    with pytest.raises(common.ConfigError, match=f"in use by process {holder.pid}"):
        bookkeeping.RunDir(str(tmp_path), "x", 1, tmp_path / folder / "checkpoint-1", common.Dist())
    holder.kill()
    holder.wait()
    bookkeeping.RunDir(str(tmp_path), "x", 1, tmp_path / folder / "checkpoint-1", common.Dist())  # free again


# ---- 3, 4. One history, one script ------------------------------------------------------------------
def test_an_older_checkpoint_is_not_resumed_in_place(finished_run):
    with pytest.raises(common.ConfigError, match="newest checkpoint is checkpoint-2; resuming an older one "
                                                 "would fork its history.*--model .*checkpoint-1"):
        bookkeeping.find_checkpoint(os.path.join(finished_run, "checkpoint-1"))


@pytest.mark.parametrize("other", [dapo, ppo])
def test_another_scripts_run_is_refused(other, finished_run):
    result = cli([f"{other.__name__}.py", "--resume", finished_run, "--num-steps", "3"])
    assert result.returncode == 2
    assert f"the run was made by grpo.py, not {other.__name__}.py" in result.stderr


# ---- 5, 11. Data files: exactly what was written, or one line naming file, line and value -------------
@pytest.mark.parametrize("row,message", [
    ({"nums": [1, 2], "target": 3.5}, "line 1: 'target' must be an integer"),
    ({"nums": [1.5, 2], "target": 3}, "line 1: 'nums' must be a non-empty list of integers"),
    ({"nums": "123", "target": 6}, "'nums' must be a non-empty list"),
    ({"nums": [-1, 2], "target": 1}, "'nums' must be"),
    ({"nums": [], "target": 1}, "'nums' must be"),
    ({"nums": [10**19, 2], "target": 3}, "'nums' must be"),
    ({"nums": [1, 2], "target": 10**19}, "'target' must be an integer of at most 18 digits"),
    ({"nums": [1, 2], "target": True}, "'target' must be"),
    ({"numbers": [1, 2], "target": 3}, "lacks the 'nums' and 'target' columns"),
])
def test_a_task_the_reward_cannot_score_is_refused(row, message, tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({"nums": [1, 2], "target": 3}) + "\n")
    with pytest.raises(common.ConfigError, match=f"--dataset='{path}', {message}" if "line" in message else message):
        common.load_countdown(str(path), test_size=1, seed=0)


@pytest.mark.parametrize("content,message", [
    (b'{"nums": [1, 2], "target": 3}\n{"nums": [1, 2], "target"\n', "line 2 is not valid JSON"),
    (b'{"nums": [1, 2], "target": NaN}\n', "'target' must be an integer"),
    (b'{"nums": [1, 2], "target": 1e400}\n', "'target' must be an integer"),
    (b'\xff\xfe{"nums": [1]}\n', "not UTF-8 text"),
    (b"", "holds no tasks"),
])
def test_a_broken_jsonl_file_gets_one_line(content, message, tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(content)
    with pytest.raises(common.ConfigError, match=message):
        common.load_countdown(str(path), test_size=1, seed=0)


def test_broken_parquet_files_and_folders_get_one_line(tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(common.ConfigError, match="it is a folder"):
        common.load_countdown(str(tmp_path / "dir.jsonl"), test_size=1, seed=0)
    for name, content in (("empty.parquet", b""), ("corrupt.parquet", b"PAR1 not really")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(common.ConfigError, match="not a readable parquet file"):
            common.load_countdown(str(tmp_path / name), test_size=1, seed=0)


# ---- 6, 9. Every flag checked up front ---------------------------------------------------------------
@pytest.mark.parametrize("algo", [grpo, dapo, ppo])
def test_every_float_flag_refuses_nan_and_infinity(algo):
    defaults = script_args(algo)
    floats = [name for name, value in bookkeeping.flat_args(defaults).items() if isinstance(value, float)]
    assert "learning_rate" in floats and len(floats) >= 8
    for name in floats:
        for bad in (math.nan, math.inf, -math.inf):
            with pytest.raises(common.ConfigError, match=f"--{name.replace('_', '-')}=.* a finite number"):
                algo.check_args(script_args(algo, **{name: bad}), 1)


@pytest.mark.parametrize("algo", [grpo, dapo, ppo])
@pytest.mark.parametrize("flags,message", [
    ({"warmup_steps": -3}, "--warmup-steps=-3 is not allowed: >= 0"),
    ({"weight_decay": -1.0}, "--weight-decay=-1.0 is not allowed: >= 0"),
    ({"log_samples_every": 0}, "--log-samples-every=0 is not allowed"),
    ({"seed": 10**23}, "--seed=.* is not allowed: in \\[0, 2\\*\\*31\\)"),
    ({"eval_size": 200, "test_size": 100}, "--eval-size=200 is not allowed: at most --test-size \\(100\\)"),
    ({"exp_name": "../../x"}, "--exp-name='../../x' is not allowed: a name without path separators"),
    ({"task_max_value": 10**18}, "--task-max-value=.* is not allowed: in \\[1, 999999999999999999\\]"),
    ({"learning_rate": -1e-6}, "--learning-rate=-1e-06 is not allowed: > 0"),
])
def test_bad_flags_stop_before_anything_loads(algo, flags, message):
    with pytest.raises(common.ConfigError, match=message):
        algo.check_args(script_args(algo, **flags), 1)


@pytest.mark.parametrize("algo", [grpo, dapo, ppo])
def test_the_logged_learning_rate_is_the_one_the_step_trained_at(algo, tiny_model_dir, tmp_path):
    """With one warm-up step, step 1 trains at half the rate and step 2 at the full rate; the log says so (read
    after the scheduler's step it would show the next step's rate: the full rate twice)."""
    args = tiny_args(algo, model=tiny_model_dir, warmup_steps=1, learning_rate=1e-3, num_steps=2,
                     runs_dir=str(tmp_path))
    out = algo.train(args, reward_fn=even_token_reward)
    _, rows = read_metrics(out["run_dir"])
    assert [row["charts/learning_rate"] for row in rows if "charts/learning_rate" in row] == pytest.approx([5e-4, 1e-3])


def test_non_finite_weights_are_detected(tiny_model_dir):
    model = common.load_model(tiny_model_dir, torch.device("cpu"))
    assert bookkeeping.weights_finite(model, common.Dist())
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = math.nan
    assert not bookkeeping.weights_finite(model, common.Dist())


# ---- 8. Settings that allow too few tasks: an error at once, not a hang ---------------------------------
@pytest.mark.parametrize("flags", [
    dict(operators="-", max_value=2),
    dict(operators="/", min_numbers=6, max_numbers=6),
    dict(operators="+", max_value=1),
])
def test_unsatisfiable_task_settings_are_a_config_error(flags):
    with pytest.raises(common.ConfigError, match="--test-size=1024 is not allowed: .* distinct solvable tasks"):
        common.load_countdown("generated", 1024, seed=1, **flags)


# ---- 10, 11. Inputs first: a failed start leaves no run folder -----------------------------------------
def broken_model(tiny_model_dir, tmp_path, damage) -> str:
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    damage(path)
    return str(path)


@pytest.mark.parametrize("damage,message", [
    (lambda p: (p / "config.json").write_text("{not json"), "config.json is not JSON"),
    (lambda p: (p / "model.safetensors").unlink(), "the folder has no weights"),
    (lambda p: os.truncate(p / "model.safetensors", 1000), "model.safetensors is damaged"),
    (lambda p: [(p / f).unlink() for f in os.listdir(p) if f.startswith(("tokenizer", "chat_template", "special"))],
     "the folder has no tokenizer"),
])
def test_a_broken_model_folder_gets_one_line_and_leaves_no_run_folder(damage, message, tiny_model_dir, tmp_path):
    args = tiny_args(grpo, model=broken_model(tiny_model_dir, tmp_path, damage), runs_dir=str(tmp_path / "runs"))
    with pytest.raises(common.ConfigError, match=f"--model=.* is not allowed: .*{message}"):
        grpo.train(args)
    assert not os.path.exists(tmp_path / "runs")


def test_a_missing_dataset_leaves_no_run_folder(tiny_model_dir, tmp_path):
    args = tiny_args(grpo, model=tiny_model_dir, runs_dir=str(tmp_path / "runs"), dataset=str(tmp_path / "no.jsonl"))
    with pytest.raises(common.ConfigError, match="does not exist"):
        grpo.train(args)
    assert not os.path.exists(tmp_path / "runs")


def test_an_unwritable_runs_dir_gets_one_line(tiny_model_dir, tmp_path):
    (tmp_path / "file").write_text("")
    args = tiny_args(grpo, model=tiny_model_dir, runs_dir=str(tmp_path / "file" / "runs"))
    with pytest.raises(common.ConfigError, match="--runs-dir=.* cannot create a run folder there"):
        grpo.train(args, reward_fn=even_token_reward)


# ---- 7. Nothing loaded from disk runs code -------------------------------------------------------------
class RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = "/tmp/rl-countdown-pickle-ran"


def test_a_crafted_trainer_state_is_refused_not_executed(finished_run):
    if os.path.exists(MARKER):
        os.remove(MARKER)
    newest = Path(finished_run, "checkpoint-2", bookkeeping.TRAINER_STATE)
    torch.save({"step": 2, "payload": RunsCode()}, newest)
    assert b"system" in newest.read_bytes()
    result = cli(["grpo.py", "--resume", finished_run, "--num-steps", "3"])
    assert result.returncode == 2 and "refused to load it" in result.stderr, result.stderr
    assert not os.path.exists(MARKER)


# ---- 12. Resume survives damage ---------------------------------------------------------------------------
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(finished_run):
    os.truncate(Path(finished_run, "checkpoint-2", bookkeeping.TRAINER_STATE), 100)
    checkpoint, state = bookkeeping.find_checkpoint(finished_run)
    assert checkpoint.name == "checkpoint-1" and state["step"] == 1
    shutil.rmtree(Path(finished_run, "checkpoint-1"))
    with open(Path(finished_run, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "charts/rew')  # a kill in the middle of a line
    os.remove(Path(finished_run, "checkpoint-2", "model.safetensors"))
    with pytest.raises(common.ConfigError, match="every checkpoint .* is damaged"):
        bookkeeping.find_checkpoint(finished_run)


def test_a_torn_metrics_line_does_not_block_resume(finished_run):
    shutil.rmtree(Path(finished_run, "checkpoint-2"))  # as if killed while step 2 was logged
    with open(Path(finished_run, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "charts/rew')
    result = cli(["grpo.py", "--resume", finished_run, "--num-steps", "2"])
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [row["step"] for row in read_metrics(finished_run)[1]]
    assert steps == [0, 1, 2]


@pytest.mark.parametrize("damage", [lambda p: p.unlink(), lambda p: p.write_text("[1, 2")])
def test_a_missing_or_corrupt_args_json_is_one_line(damage, finished_run):
    damage(Path(finished_run, "args.json"))
    with pytest.raises(common.ConfigError, match="args.json is missing or not a JSON object"):
        bookkeeping.resume_args(script_args(grpo, resume=finished_run), script_args(grpo), finished_run, "grpo",
                           {"num_steps"})


# ---- 13. A full disk loses no work ----------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 60 MiB tmpfs: the first checkpoint of the tiny model (~42 MB with its AdamW state) fits, a
    second beside it does not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=60m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_keeps_the_last_checkpoint_and_says_so(tiny_model_dir, small_disk, capfd):
    args = tiny_args(grpo, model=tiny_model_dir, runs_dir=str(small_disk), num_steps=3, save_every=1,
                     keep_checkpoints=2)
    with pytest.raises(common.RunStopped,
                       match=r"cannot write .*checkpoint-3 \(disk full.*the previous checkpoint is intact"):
        grpo.train(args, reward_fn=even_token_reward)
    assert "checkpoint-2 (disk full" in capfd.readouterr().err  # a failed save mid-run: said, and training went on
    (run_dir,) = [p for p in small_disk.iterdir() if p.is_dir()]
    assert [p.name for p in bookkeeping.complete_checkpoints(run_dir)] == ["checkpoint-1"]
    assert not list(run_dir.glob("*.tmp"))
    assert [row["step"] for row in read_metrics(run_dir)[1]] == [0, 1, 2, 3]
    checkpoint, state = bookkeeping.find_checkpoint(str(run_dir))  # and it resumes from there
    assert state["step"] == 1
