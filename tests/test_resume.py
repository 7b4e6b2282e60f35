"""Runs that survive: kill (SIGKILL) or stop (SIGTERM) a run, resume it, and get the run that was never
interrupted: the same logged rewards and losses, the same final weights (CPU, fixed seed)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

import bookkeeping

import common
from conftest import ROOT, checkpoint_weights, read_metrics, script_args, subprocess_env, tiny_args, tiny_flags

TOY = os.path.join(ROOT, "tests", "toy_run.py")


def run_dir_of(runs):
    (name,) = os.listdir(runs)
    return os.path.join(runs, name)


def rows(run_dir):
    skip = ("time/", "charts/tokens_per_second")
    return [{k: v for k, v in row.items() if not k.startswith(skip)} for row in read_metrics(run_dir)[1]]


def interrupt(cmd, runs, sig):
    """Start a run, and send `sig` once its first checkpoint is complete."""
    proc = subprocess.Popen(cmd, env=subprocess_env("1"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if os.path.isdir(runs) and os.listdir(runs) and bookkeeping.complete_checkpoints(run_dir_of(runs)):
            proc.send_signal(sig)
            break
        time.sleep(0.05)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out + err


@pytest.mark.parametrize("algo,sig", [("grpo", signal.SIGKILL), ("dapo", signal.SIGTERM), ("ppo", signal.SIGTERM)])
def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(algo, sig, peaked_model_dir, tmp_path):
    base = [sys.executable, TOY, algo, *tiny_flags(
        model=peaked_model_dir, num_steps=4, save_every=2, keep_checkpoints=2, prompts_per_step=4, group_size=4,
        max_new_tokens=8, num_minibatches=2, micro_batch_size=16, log_samples_every=100)]
    whole = subprocess.run(base + ["--runs-dir", str(tmp_path / "whole")], env=subprocess_env("1"), cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-3000:]

    runs = str(tmp_path / "parts")
    code, output = interrupt(base + ["--runs-dir", runs], runs, sig)
    run_dir = run_dir_of(runs)
    if sig == signal.SIGTERM:  # the step in flight finishes, is saved, and the exit is clean
        assert code == 0, output[-3000:]
        assert f"continue with: python {algo}.py --resume {run_dir}" in output
    stopped_at = int(bookkeeping.complete_checkpoints(run_dir)[-1].name.split("-")[1])
    if stopped_at == 4:
        pytest.skip("the run finished before the signal arrived")
    resumed = subprocess.run([sys.executable, TOY, algo, "--resume", run_dir], env=subprocess_env("1"), cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected, got = rows(run_dir_of(tmp_path / "whole")), rows(run_dir)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]  # steps after the checkpoint were logged again
    assert got == expected
    a, b = (checkpoint_weights(os.path.join(d, "checkpoint-4")) for d in (run_dir_of(tmp_path / "whole"), run_dir))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert len(bookkeeping.complete_checkpoints(run_dir)) == 2  # --keep-checkpoints


def write_checkpoint(path, step):
    """A minimal complete checkpoint: weights that read back and a trainer state."""
    path.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))
    torch.save({"step": step}, path / bookkeeping.TRAINER_STATE)


def test_half_written_checkpoints_are_never_resumed(tmp_path):
    write_checkpoint(tmp_path / "checkpoint-2", 2)
    write_checkpoint(tmp_path / "checkpoint-4.tmp", 4)  # killed while writing
    (tmp_path / "checkpoint-6").mkdir()  # no trainer state: not written by this code path
    assert bookkeeping.find_checkpoint(str(tmp_path))[0].name == "checkpoint-2"
    with pytest.raises(common.ConfigError, match="--resume='.*' is not allowed: no complete checkpoint"):
        bookkeeping.find_checkpoint(str(tmp_path / "nothing"))


def test_resume_refuses_a_conflicting_flag(tmp_path):
    import grpo

    ckpt = tmp_path / "run" / "checkpoint-2"
    write_checkpoint(ckpt, 2)
    recorded = bookkeeping.flat_args(script_args(grpo, learning_rate=1e-4))
    (tmp_path / "run" / "args.json").write_text(json.dumps(recorded))
    args, found, _ = bookkeeping.resume_args(script_args(grpo, resume=str(tmp_path / "run"), num_steps=50),
                                        script_args(grpo), str(tmp_path / "run"), "grpo")
    assert found == ckpt and args.learning_rate == 1e-4 and args.num_steps == 50
    with pytest.raises(common.ConfigError, match=r"--learning-rate=0.01 is not allowed with --resume: the run was "
                                                 r"started with 0.0001"):
        bookkeeping.resume_args(script_args(grpo, learning_rate=1e-2), script_args(grpo), str(tmp_path / "run"), "grpo")


def test_resume_latest_takes_the_newest_run_of_the_experiment_and_says_which(tiny_model_dir, tmp_path, capsys):
    import grpo

    flags = dict(model=tiny_model_dir, max_new_tokens=3, eval_size=0, test_size=4, save_every=1, runs_dir=str(tmp_path))
    older = grpo.train(tiny_args(grpo, **flags))["run_dir"]
    time.sleep(1.1)  # run folders are named by the second they start
    newer = grpo.train(tiny_args(grpo, **flags))["run_dir"]
    grpo.train(tiny_args(grpo, **flags, exp_name="other"))  # newest of all, but another experiment
    assert bookkeeping.newest_run("latest", str(tmp_path), "grpo") == newer != older
    assert bookkeeping.newest_run(str(tmp_path), "ignored", "grpo") == newer  # a folder of runs in place of --runs-dir
    assert bookkeeping.newest_run(newer, "ignored", "grpo") == newer  # a run folder is itself
    assert "the newest run of grpo" in capsys.readouterr().err
    resumed = grpo.train(tiny_args(grpo, **flags, num_steps=2, resume="latest"), typed_flags={"resume", "num_steps"})
    assert resumed["run_dir"] == newer and len(rows(newer)) == 2 and len(rows(older)) == 1
    with pytest.raises(common.ConfigError, match="--resume='latest' is not allowed: no run of --exp-name='nothing'"):
        bookkeeping.newest_run("latest", str(tmp_path), "nothing")
