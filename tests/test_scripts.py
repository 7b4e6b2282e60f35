"""The scripts as a user runs them: flags, clear errors, a real run with the bundled model, torchrun."""

import glob
import json
import os
import re

import pytest

from conftest import read_metrics as metrics
from conftest import run_script as run
from conftest import script_args, tiny_flags

SCRIPTS = ["grpo.py", "dapo.py", "ppo.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_documents_the_shared_flags(script):
    out = run([script, "--help"]).stdout
    for flag in ["--model", "--num-steps", "--prompts-per-step", "--group-size", "--max-new-tokens", "--temperature",
                 "--learning-rate", "--beta", "--seed", "--eval-every", "--save-every", "--track"]:
        assert flag in out, flag


@pytest.mark.parametrize("script,flags,message", [
    ("grpo.py", ["--group-size", "1"], "--group-size=1 is not allowed: >= 2"),
    ("grpo.py", ["--dataset", "missing.jsonl"], "--dataset='missing.jsonl' is not allowed: the file does not exist"),
    ("grpo.py", ["--model", "/nonexistent/folder"], "--model='/nonexistent/folder' is not allowed"),
    ("dapo.py", ["--overlong-buffer", "300"], "--overlong-buffer=300 is not allowed: in [0, --max-new-tokens)"),
    ("ppo.py", ["--lam", "1.5"], "--lam=1.5 is not allowed: in [0, 1]"),
])
def test_bad_flags_exit_with_a_one_line_error(script, flags, message, tmp_path):
    result = run([script, *flags, "--runs-dir", str(tmp_path)], timeout=120)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_track_without_wandb_is_refused_before_the_run_folder_exists(tmp_path):
    """wandb is a test dependency, so grpo.py runs with it hidden: `sys.modules["wandb"] = None` makes both
    `import wandb` and the check's importlib.util.find_spec("wandb") find no wandb, as where it is not installed."""
    hidden = ("import runpy, sys; sys.modules['wandb'] = None; sys.argv[0] = 'grpo.py'; "
              "runpy.run_path('grpo.py', run_name='__main__')")
    result = run(["-c", hidden, "--track", "--runs-dir", str(tmp_path / "runs")], timeout=120)
    assert result.returncode == 2
    assert "--track=True is not allowed: off unless wandb is installed" in result.stderr
    assert not (tmp_path / "runs").exists()  # no run folder, no args.json, no .lock


@pytest.mark.parametrize("algo,fields,message", [
    ("grpo", {"clip_eps": 1.5}, "--clip-eps=1.5 is not allowed: in (0, 1)"),
    ("grpo", {"max_new_tokens": 0}, "--max-new-tokens=0 is not allowed: a positive integer"),
    ("grpo", {"num_minibatches": 3}, "--num-minibatches=3 is not allowed: a divisor of the sequences"),
    ("grpo", {"prompts_per_step": 3}, "--prompts-per-step=3 is not allowed: a multiple of the number of processes (2)"),
    ("dapo", {"group_size": 1}, "--group-size=1 is not allowed: >= 2"),
    ("dapo", {"clip_high": 0.0}, "--clip-high=0.0 is not allowed: > 0"),
    ("dapo", {"max_generation_batches": 0}, "--max-generation-batches=0 is not allowed: a positive integer"),
    ("ppo", {"critic_warmup_steps": 9, "num_steps": 9}, "--critic-warmup-steps=9 is not allowed"),
    ("ppo", {"prompts_per_step": 3, "num_minibatches": 2}, "--num-minibatches=2 is not allowed"),
    ("ppo", {"keep_checkpoints": -1}, "--keep-checkpoints=-1 is not allowed: >= 0"),
    ("grpo", {"backend": "vllm", "vllm_sleep_mode": True, "device": "cpu"},
     "--vllm-sleep-mode=True is not allowed: off unless --backend vllm on a GPU"),
    ("dapo", {"vllm_importance_cap": 2.0}, "--vllm-importance-cap=2.0 is not allowed: 0 unless --backend vllm"),
])
def test_flags_are_checked_before_anything_loads(algo, fields, message):
    import importlib

    import common

    module = importlib.import_module(algo)
    world_size = 2 if "prompts_per_step" in fields and algo == "grpo" else 1
    with pytest.raises(common.ConfigError) as err:
        module.check_args(script_args(module, **fields), world_size)
    assert message in str(err.value)


def test_grpo_runs_with_the_bundled_model(tmp_path):
    result = run(["grpo.py", *tiny_flags(model="bundled", num_steps=2, max_new_tokens=16, learning_rate=1e-5,
                                         num_minibatches=2, runs_dir=tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert set(rows[0]) == {"step", "charts/eval_accuracy", "charts/eval_format_rate", "charts/eval_response_length",
                            "charts/eval_best_constant", "charts/eval_uniform_guess", "time/eval"}
    for key in ["charts/reward", "charts/accuracy", "charts/format_rate", "losses/kl_ref", "losses/policy_loss",
                "losses/grad_norm", "charts/eval_accuracy", "time/generation", "time/update"]:
        assert key in rows[-1], key
    assert rows[1]["losses/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    # where the run is and how to see it, at the start and at the end
    assert result.stdout.count(f"run folder: {run_dir}  (curves: tensorboard --logdir {tmp_path})") == 2
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run_dir))
    samples = [json.loads(line) for line in open(os.path.join(run_dir, "samples.jsonl"))]
    assert samples and "Let me solve this step by step" in samples[0]["prompt"]
    # the checkpoint is a plain HF folder that transformers loads as it is
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = os.path.join(run_dir, "checkpoint-2")
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert model.config.num_hidden_layers == 30
    assert AutoTokenizer.from_pretrained(ckpt).eos_token == "<|im_end|>"
    # transformers 4.x reads a top-level rope_theta and defaults it to 10000 when absent: the checkpoint must
    # give it the model's own value (5.x keeps it under rope_parameters only)
    saved = json.load(open(os.path.join(ckpt, "config.json")))
    assert saved.get("rope_theta", 10000.0) == model.config.rope_parameters["rope_theta"] == 100000.0


# grpo.py and ppo.py under --fsdp: tests/test_sharded_checkpoints.py (a run, its resume, its consolidation)
@pytest.mark.parametrize("script,parallel", [("grpo.py", "--no-fsdp"), ("dapo.py", "--fsdp")])
def test_torchrun_two_cpu_processes(script, parallel, tiny_model_dir, tmp_path):
    # DDP under torchrun for dapo.py and ppo.py is covered by their split tests (tests/update_worker.py)
    result = run([script, *tiny_flags(model=tiny_model_dir, num_steps=2, max_new_tokens=8, eval_size=3, beta=0.01,
                                      num_minibatches=2, runs_dir=tmp_path), parallel],  # 2 sequences per process
                 torchrun=True, threads="1")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, rows = metrics(tmp_path)  # rank 0 alone writes
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["charts/response_length"] > 0
    ckpt = os.path.join(run_dir, "checkpoint-2")
    if parallel == "--no-fsdp":  # DDP: the checkpoint is a whole HF model
        from transformers import AutoModelForCausalLM

        assert sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(ckpt).parameters()) == sum(
            p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    else:  # FSDP2: each process's shards (torch.distributed.checkpoint), and the run resumes from them
        assert os.path.isfile(os.path.join(ckpt, "sharded", ".metadata"))
        assert not glob.glob(os.path.join(ckpt, "*.safetensors"))
        more = run([script, "--resume", run_dir, "--num-steps", "3"], torchrun=True, threads="1")
        assert more.returncode == 0, more.stderr[-3000:]
        assert [r["step"] for r in metrics(tmp_path)[1]] == [0, 1, 2, 3]


def test_a_finished_torchrun_worker_ends_cleanly_while_a_gloo_thread_still_runs_python():
    # such a thread aborts or crashes its process once the interpreter shuts down; common.run_command leaves a
    # finished worker before that. The same worker returning as a plain script must crash here, else the test
    # shows nothing (and, with a torch or Python that no longer crashes, run_command's os._exit is not needed)
    plain = run(["tests/teardown_worker.py", "return"], timeout=120, torchrun=True, threads="1")
    crashed = re.search(r"Signal (6|11) \(SIG(ABRT|SEGV)\)", plain.stderr)
    # both ranks got past their command (a Python error before that would be no evidence); the fatal error's
    # report may show the callback's own line, so the stderr cannot tell the two apart
    assert crashed and plain.stdout.count("command returned") == 2, plain.stdout + plain.stderr[-3000:]
    ended = run(["tests/teardown_worker.py", "run_command"], timeout=120, torchrun=True, threads="1")
    assert ended.returncode == 0 and ended.stdout.count("command returned") == 2, ended.stderr[-3000:]


@pytest.mark.parametrize("dynamic_sampling", ["--dynamic-sampling"])  # without it: the tiny-model tests, the study
def test_dapo_runs_with_the_bundled_model(dynamic_sampling, tmp_path):
    result = run(["dapo.py", *tiny_flags(model="bundled", num_steps=2, max_new_tokens=12, learning_rate=1e-5,
                                         num_minibatches=2, runs_dir=tmp_path, max_generation_batches=2,
                                         overlong_buffer=8, dynamic_sampling_metric="reward"),
                  dynamic_sampling])  # the bundled model is never right: filter on rewards
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, rows = metrics(tmp_path)
    assert rows[0]["step"] == 0 and "charts/eval_accuracy" in rows[0]  # the starting model
    rows = rows[1:]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        if dynamic_sampling == "--no-dynamic-sampling":
            assert r["charts/generation_batches"] == 1 and r["charts/dropped_fraction"] == 0
        else:  # a second batch only after an uninformative group; a shortfall is announced
            batches = r["charts/generation_batches"]
            zero_std = r["charts/zero_std_fraction"]
            assert (batches == 1 and zero_std == 0) or (batches == 2 and zero_std > 0)
            trained_groups = round((1 - r["charts/dropped_fraction"]) * 2 * batches)
            if trained_groups < 2:
                assert "dynamic sampling stopped at --max-generation-batches=2" in result.stdout + result.stderr
    for r in rows:
        # nothing to train on only when every group was dropped; DAPO has no KL term by default: none is logged
        assert ("losses/policy_loss" in r) == (r["charts/dropped_fraction"] < 1)
        assert "losses/kl_ref" not in r
        if r["charts/truncated_fraction"] == 1 and r["charts/format_rate"] == 0:
            assert r["charts/reward"] == -1.0  # soft overlong punishment at max_new_tokens: -overlong_penalty
    assert os.path.exists(os.path.join(run_dir, "checkpoint-2", "config.json"))


def test_ppo_runs_with_the_bundled_model(tmp_path):
    result = run(["ppo.py", *tiny_flags(model="bundled", num_steps=2, prompts_per_step=1, group_size=1,
                                        max_new_tokens=16, learning_rate=1e-5, runs_dir=tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, rows = metrics(tmp_path)
    for key in ["losses/value_loss", "losses/value_clipfrac", "charts/explained_variance", "charts/value_mean",
                "charts/return_mean", "losses/policy_loss", "losses/entropy", "charts/eval_accuracy"]:
        assert key in rows[-1], key
    assert "charts/zero_std_fraction" not in rows[-1]  # one completion per prompt: no groups to compare
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    ckpt = os.path.join(run_dir, "checkpoint-2")
    assert AutoModelForCausalLM.from_pretrained(ckpt).config.num_hidden_layers == 30
    assert AutoModelForTokenClassification.from_pretrained(os.path.join(ckpt, "critic")).config.num_labels == 1
