"""`final/`, the policy's weights alone that a run writes once it has done all its steps (bookkeeping.export_final):
what it holds, that transformers and vLLM load it, that it is the last checkpoint's weights in --final-dtype, that a
stopped or diverged run has none, under FSDP2 too, and that a full disk or a link in its place loses nothing."""

import gc
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import bookkeeping
import common
import dapo
import grpo
import ppo
from conftest import (
    checkpoint_weights, even_token_reward, make_tiny_model_dir, script_args, subprocess_env, tiny_args,
)

FINAL = bookkeeping.FINAL


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory) -> str:
    """The tiny test model with head size 32, which vLLM's CPU attention takes (as in tests/test_vllm.py)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("export-tiny"), hidden_size=128)


@pytest.fixture(scope="module")
def bf16_run(small_model_dir, tmp_path_factory) -> Path:
    """A finished 2-step GRPO run computing in bfloat16 (a CPU takes --compute-dtype bfloat16), default
    --final-dtype (compute); the toy reward moves the weights."""
    args = tiny_args(grpo, model=small_model_dir, runs_dir=str(tmp_path_factory.mktemp("bf16")), num_steps=2,
                     compute_dtype="bfloat16")
    return Path(grpo.train(args, reward_fn=even_token_reward)["run_dir"])


def assert_is_the_last_checkpoint(run_dir: Path, dtype: torch.dtype, step: int) -> dict:
    """final/'s weights are checkpoint-<step>'s (float32) cast to `dtype`, name for name; config.json says `dtype`."""
    final, last = checkpoint_weights(run_dir / FINAL), checkpoint_weights(run_dir / f"checkpoint-{step}")
    assert final.keys() == last.keys()  # tied embeddings written once, as in the checkpoint
    for name, tensor in last.items():
        assert final[name].dtype == dtype and torch.equal(final[name], tensor.to(dtype)), name
    config = json.loads((run_dir / FINAL / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == str(dtype).removeprefix("torch.")
    assert not (run_dir / f"{FINAL}.tmp").exists()
    return final


def test_a_finished_run_writes_the_weights_alone_in_the_compute_dtype(bf16_run, small_model_dir):
    names = set(os.listdir(bf16_run / FINAL))
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= names
    assert not names & {bookkeeping.TRAINER_STATE, "critic", "training_args.bin"}
    final = assert_is_the_last_checkpoint(bf16_run, torch.bfloat16, step=2)
    start = checkpoint_weights(small_model_dir)
    assert any(not torch.equal(final[k], start[k].bfloat16()) for k in start)  # trained weights, not the start's
    # half the checkpoint's weights file, and no optimizer state beside it
    assert (bf16_run / FINAL / "model.safetensors").stat().st_size < 0.6 * (
        bf16_run / "checkpoint-2" / "model.safetensors").stat().st_size

    model = AutoModelForCausalLM.from_pretrained(bf16_run / FINAL)  # as a user (and lm-eval's hf backend) loads it
    assert model.dtype == torch.bfloat16
    assert all(torch.equal(model.state_dict()[k], v) for k, v in final.items())
    tokenizer = AutoTokenizer.from_pretrained(bf16_run / FINAL)
    text = "Using the numbers [3, 5], create an equation that equals 8."
    assert tokenizer(text).input_ids == AutoTokenizer.from_pretrained(small_model_dir)(text).input_ids
    ids = tokenizer(text, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 3


def test_a_stopped_run_has_no_final_until_resumed_to_its_end(small_model_dir, tmp_path):
    calls = []

    def stop_in_step_1(rollout, tasks):  # a SIGTERM in step 1: the step finishes, is saved, and the run stops
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return even_token_reward(rollout, tasks)

    flags = dict(model=small_model_dir, runs_dir=str(tmp_path), num_steps=2, compute_dtype="bfloat16",
                 final_dtype="float32")
    run_dir = Path(grpo.train(tiny_args(grpo, **flags), reward_fn=stop_in_step_1)["run_dir"])
    assert [p.name for p in bookkeeping.complete_checkpoints(run_dir)] == ["checkpoint-1"]
    assert not (run_dir / FINAL).exists() and not (run_dir / f"{FINAL}.tmp").exists()

    grpo.train(tiny_args(grpo, **flags, resume=str(run_dir)), reward_fn=even_token_reward, typed_flags={"resume"})
    # --final-dtype float32 with bfloat16 compute: the float32 weights bit for bit
    assert_is_the_last_checkpoint(run_dir, torch.float32, step=2)


def test_a_diverged_run_has_no_final(tiny_model_dir, tmp_path):
    def nan_reward(rollout, tasks):  # a non-finite gradient at once: the update is skipped, the run stops
        n = len(rollout.texts)
        return [math.nan] * n, [0.0] * n, [1.0] * n

    args = tiny_args(grpo, model=tiny_model_dir, runs_dir=str(tmp_path), num_steps=2, max_skipped_steps=1)
    with pytest.raises(common.RunStopped, match="non-finite gradient"):
        grpo.train(args, reward_fn=nan_reward)
    (run_dir,) = tmp_path.iterdir()
    assert [p.name for p in bookkeeping.complete_checkpoints(run_dir)] == ["checkpoint-1"]
    assert not (run_dir / FINAL).exists()


@pytest.mark.parametrize("module", [dapo, ppo], ids=["dapo", "ppo"])
def test_dapo_and_ppo_export_the_policy_alone(module, tiny_model_dir, tmp_path):
    out = module.train(tiny_args(module, model=tiny_model_dir, runs_dir=str(tmp_path)), reward_fn=even_token_reward)
    run_dir = Path(out["run_dir"])
    assert (run_dir / "checkpoint-1" / "critic").is_dir() == (module is ppo)
    assert not {"critic", bookkeeping.TRAINER_STATE} & set(os.listdir(run_dir / FINAL))
    assert_is_the_last_checkpoint(run_dir, torch.float32, step=1)  # the CPU's compute dtype


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_serves_final(bf16_run):
    """vLLM on final/ as a user starts it (dtype from config.json): bfloat16, and greedy tokens come out."""
    code = ("import json, sys; from vllm import LLM, SamplingParams; "
            "llm = LLM(model=sys.argv[1], max_model_len=128, enforce_eager=True); "
            "out = llm.generate([sys.argv[2]], SamplingParams(max_tokens=4, temperature=0)); "
            "print(json.dumps({'dtype': str(llm.llm_engine.model_config.dtype), "
            "'tokens': list(out[0].outputs[0].token_ids)}))")
    prompt = "Using the numbers [3, 5], create an equation that equals 8."
    env = {**subprocess_env(), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    result = subprocess.run([sys.executable, "-c", code, str(bf16_run / FINAL), prompt], capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["dtype"] == "torch.bfloat16" and len(found["tokens"]) == 4, found
    # the same first greedy token as transformers on the same file (a wide margin on this tiny model)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(bf16_run / FINAL), AutoTokenizer.from_pretrained(
        bf16_run / FINAL)
    logits = model(tokenizer(prompt, return_tensors="pt").input_ids).logits[0, -1].float()
    assert found["tokens"][0] == logits.argmax().item(), (found, logits.topk(2))


# ---- A full disk, and links where final/ goes ---------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """mount(MiB): a tmpfs of that size, unmounted after the test (needs root; skipped without it)."""
    mounts = []

    def mount(mib: int) -> Path:
        folder = tmp_path / f"disk{len(mounts)}"
        folder.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(folder)],
                          capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounts.append(folder)
        return folder

    yield mount
    gc.collect()  # the stopped run's open log files
    for folder in mounts:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_full_disk_at_the_export_keeps_the_last_checkpoint_and_says_so(tiny_model_dir, small_disk):
    disk = small_disk(50)  # the tiny model's checkpoint (~42 MB with its AdamW state) fits, final/ (~17 MB) then not
    with pytest.raises(common.RunStopped, match=r"^cannot write \S+/final \(disk full, \d+ MiB free: .*\); the trained "
                                                r"weights are in \S+/checkpoint-1, which is intact$"):
        grpo.train(tiny_args(grpo, model=tiny_model_dir, runs_dir=str(disk)), reward_fn=even_token_reward)
    (run_dir,) = [p for p in disk.iterdir() if p.is_dir()]
    assert not (run_dir / FINAL).exists() and not (run_dir / f"{FINAL}.tmp").exists()
    checkpoint, state = bookkeeping.find_checkpoint(str(run_dir))
    assert checkpoint.name == "checkpoint-1" and state["step"] == 1


def test_a_full_disk_while_a_checkpoint_writes_its_weights_is_one_line_too(tiny_model_dir, small_disk):
    disk = small_disk(10)  # the weights file (12.6 MB) does not fit: safetensors raises its own error, not an OSError
    with pytest.raises(common.RunStopped, match=r"^cannot write \S+/checkpoint-1 \(disk full, .*No space left"):
        grpo.train(tiny_args(grpo, model=tiny_model_dir, runs_dir=str(disk)), reward_fn=even_token_reward)
    (run_dir,) = [p for p in disk.iterdir() if p.is_dir()]
    assert not list(run_dir.glob("*.tmp")) and not (run_dir / FINAL).exists()


def test_links_where_final_goes_are_replaced_never_written_through(tiny_model_dir, tmp_path):
    outside, run_dir = tmp_path / "outside", tmp_path / "run"
    outside.mkdir()
    run_dir.mkdir()
    (outside / "precious").write_text("kept")
    for name in (FINAL, f"{FINAL}.tmp"):
        os.symlink(outside, run_dir / name)
    with pytest.raises(common.ConfigError, match=r"final(\.tmp)? is a symbolic link"):  # --resume refuses them
        bookkeeping.check_run_folder(run_dir, "--resume")
    model, tokenizer = common.load_model(tiny_model_dir, torch.device("cpu")), common.load_tokenizer(tiny_model_dir)
    bookkeeping.export_final(model, tokenizer, str(run_dir), common.Dist(), torch.bfloat16)
    assert os.listdir(outside) == ["precious"]
    assert not (run_dir / FINAL).is_symlink() and not os.path.lexists(run_dir / f"{FINAL}.tmp")
    final = checkpoint_weights(run_dir / FINAL)
    assert final.keys() == checkpoint_weights(tiny_model_dir).keys()  # the tied lm_head is not written twice
    assert {t.dtype for t in final.values()} == {torch.bfloat16}


def test_an_unknown_final_dtype_is_one_line():
    with pytest.raises(common.ConfigError, match=r"^--final-dtype='bf16' is not allowed: 'compute' or 'float32'$"):
        bookkeeping.check_common_args(script_args(grpo, final_dtype="bf16"))
