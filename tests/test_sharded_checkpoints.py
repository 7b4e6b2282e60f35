"""Sharded checkpoints under torchrun --fsdp (2 processes, CPU): every process writes its shards of the weights
and AdamW states with torch.distributed.checkpoint, nothing is gathered; --resume continues bit for bit;
tools/consolidate.py makes a plain HF folder of one; evaluate.py and a one-process --resume refuse one in a line."""

import glob
import os
import pickle
import re
import shutil
import subprocess
import sys

import pytest
import torch

import bookkeeping
import common
from conftest import ROOT, checkpoint_weights, read_metrics, run_script, tiny_flags

TOY = os.path.join("tests", "toy_run.py")


def flags(model, **overrides):
    return tiny_flags(**{**dict(model=model, num_steps=4, save_every=2, keep_checkpoints=2, prompts_per_step=4,
                                group_size=4, max_new_tokens=8, num_minibatches=2, micro_batch_size=16,
                                log_samples_every=100, eval_size=0, fsdp=True, final_dtype="float32"), **overrides})


def rows(run_dir):
    skip = ("time/", "charts/tokens_per_second")
    return [{k: v for k, v in row.items() if not k.startswith(skip)} for row in read_metrics(run_dir)[1]]


@pytest.fixture(scope="module", params=["grpo", "ppo"])  # dapo saves and restores through the same code as grpo
def runs(request, peaked_model_dir, tmp_path_factory):
    """(algo, the run of 4 steps straight, the run stopped after 2 and resumed to 4), each under torchrun --fsdp."""
    algo, tmp = request.param, tmp_path_factory.mktemp(f"sharded-{request.param}")
    whole = run_script([TOY, algo, *flags(peaked_model_dir), "--runs-dir", str(tmp / "whole")], torchrun=True,
                       threads="1")
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run_script([TOY, algo, *flags(peaked_model_dir, num_steps=2), "--runs-dir", str(tmp / "parts")],
                       torchrun=True, threads="1")
    assert first.returncode == 0, first.stderr[-3000:]
    (parts,) = glob.glob(str(tmp / "parts" / "*"))
    resumed = run_script([TOY, algo, "--resume", parts, "--num-steps", "4"], torchrun=True, threads="1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (whole_dir,) = glob.glob(str(tmp / "whole" / "*"))
    return algo, whole_dir, parts


def test_a_checkpoint_under_fsdp_is_sharded_and_nothing_is_gathered(runs):
    algo, whole, parts = runs
    for run_dir in (whole, parts):
        assert [p.name for p in bookkeeping.complete_checkpoints(run_dir)] == ["checkpoint-2", "checkpoint-4"]
        assert not glob.glob(os.path.join(run_dir, "*.tmp"), include_hidden=True)
        for checkpoint in bookkeeping.complete_checkpoints(run_dir):
            names = set(os.listdir(checkpoint))
            assert {"config.json", "generation_config.json", "tokenizer.json", "trainer_state.pt"} <= names
            assert not glob.glob(str(checkpoint / "**" / "*.safetensors"), recursive=True)
            shards = sorted(os.listdir(checkpoint / "sharded"))
            assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per process
            state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
            owners = {"optimizer": "model", **({"critic_optimizer": "critic"} if algo == "ppo" else {})}
            assert state["sharded"] == {"world_size": 2, "owners": owners}
            assert all(state[name] == "sharded" for name in owners)  # no AdamW moments in trainer_state.pt
            assert state["step"] == int(checkpoint.name.split("-")[1]) and "scheduler" in state and "rng" in state
            if algo == "ppo":
                assert os.listdir(checkpoint / "critic") == ["config.json"]
            metadata = bookkeeping.read_dcp_metadata(checkpoint / "sharded" / ".metadata")
            keys = set(metadata.state_dict_metadata)
            assert "model.model.embed_tokens.weight" in keys
            assert any(k.startswith("optimizer.state.") and k.endswith(".exp_avg_sq") for k in keys)
            assert any(k.startswith("critic.") for k in keys) == (algo == "ppo")


def test_a_resumed_sharded_run_equals_the_uninterrupted_one(runs):
    algo, whole, parts = runs
    assert [r["step"] for r in rows(parts)] == [1, 2, 3, 4]
    assert rows(parts) == rows(whole)
    a, b = checkpoint_weights(os.path.join(whole, "final")), checkpoint_weights(os.path.join(parts, "final"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_consolidation_gives_the_weights_the_run_had(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    algo, whole, _ = runs
    if algo != "grpo":
        pytest.skip("the same code for every script")
    out = tmp_path / "consolidated"
    done = run_script([os.path.join("tools", "consolidate.py"), os.path.join(whole, "checkpoint-4"), "--out",
                       str(out)], threads="1")
    assert done.returncode == 0, done.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    final = checkpoint_weights(os.path.join(whole, "final"))  # float32 (--final-dtype float32), gathered at step 4
    loaded = model.state_dict()
    assert set(loaded) == set(final) and all(torch.equal(loaded[k], final[k]) for k in final)
    again = run_script([os.path.join("tools", "consolidate.py"), os.path.join(whole, "checkpoint-4"), "--out",
                        str(out)], threads="1")
    assert again.returncode == 2 and "--out=" in again.stderr and "exists" in again.stderr
    plain = run_script([os.path.join("tools", "consolidate.py"), os.path.join(whole, "final"), "--out",
                        str(tmp_path / "x")], threads="1")
    assert plain.returncode == 2 and "not a sharded checkpoint" in plain.stderr


def test_evaluate_and_a_one_process_resume_refuse_a_sharded_checkpoint_in_one_line(runs):
    algo, whole, _ = runs
    if algo != "grpo":
        pytest.skip("the same code for every script")
    for target in (whole, os.path.join(whole, "checkpoint-4")):
        result = run_script(["evaluate.py", target])
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert "sharded checkpoint (--fsdp)" in result.stderr and "tools/consolidate.py" in result.stderr
    result = run_script([TOY, "grpo", "--resume", whole, "--num-steps", "6"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert "--resume=" in line and "sharded over 2 processes (--fsdp)" in line and "tools/consolidate.py" in line


def test_a_full_disk_while_shards_are_written_keeps_the_previous_checkpoint(tiny_model_dir, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=70m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:  # checkpoint-1 (55 MB: weights, AdamW moments, tokenizer) fits, checkpoint-2 then not; it is the last save
        result = run_script([TOY, "grpo", *flags(tiny_model_dir, num_steps=2, save_every=1), "--runs-dir", str(disk)],
                            torchrun=True, threads="1")
        assert result.returncode == 1, result.stderr[-3000:]
        assert re.search(r"stopped: cannot write \S+/checkpoint-2 \(disk full, \d+ MiB free: .*\); the previous "
                         r"checkpoint is intact", result.stderr), result.stderr[-3000:]
        (run_dir,) = [p for p in disk.iterdir() if p.is_dir()]
        assert not list(run_dir.glob("*.tmp")) and not (run_dir / "final").exists()
        checkpoint, state = bookkeeping.find_checkpoint(str(run_dir))
        assert checkpoint.name == "checkpoint-1" and state["step"] == 1
    finally:
        subprocess.run(["umount", str(disk)], check=True)


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_damaged_or_crafted_sharded_checkpoints_are_refused(runs, tmp_path):
    algo, whole, _ = runs
    if algo != "grpo":
        pytest.skip("the same code for every script")
    run_dir = tmp_path / "run"
    shutil.copytree(whole, run_dir, ignore=shutil.ignore_patterns(".lock", "final"))
    assert bookkeeping.find_checkpoint(str(run_dir))[0].name == "checkpoint-4"
    os.remove(run_dir / "checkpoint-4" / "sharded" / "__1_0.distcp")  # a process's shards lost
    assert bookkeeping.find_checkpoint(str(run_dir))[0].name == "checkpoint-2"
    with open(run_dir / "checkpoint-2" / "sharded" / ".metadata", "wb") as f:  # a pickle that would run code
        pickle.dump(Payload(), f)
    with pytest.raises(common.ConfigError, match="refused to load it"):
        bookkeeping.find_checkpoint(str(run_dir))
    assert not os.path.exists("PWNED") and not os.path.exists(os.path.join(ROOT, "PWNED"))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
