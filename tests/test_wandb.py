"""--track with a real wandb in offline mode (no account, no network): a resumed run continues the W&B run
whose id its run folder keeps, --wandb-entity reaches that run, and a W&B start that fails leaves no run
folder. Each W&B run is read back from its offline folder `<WANDB_DIR>/wandb/offline-run-<time>-<id>/`
and its transaction log `run-<id>.wandb` (what `wandb sync` uploads)."""

import os
import struct

import pytest

import bookkeeping
from conftest import read_metrics, run_script, tiny_flags

pytest.importorskip("wandb", reason="wandb is optional; requirements.txt installs it for these tests")


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch):
    """W&B offline and silent, writing under tmp_path only, with none of the caller's WANDB_* settings;
    the folder that will hold its offline runs."""
    for name in [n for n in os.environ if n.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": tmp_path,
                        "WANDB_CONFIG_DIR": tmp_path / "wandb-config", "WANDB_CACHE_DIR": tmp_path / "wandb-cache",
                        "WANDB_DATA_DIR": tmp_path / "wandb-data"}.items():
        monkeypatch.setenv(name, str(value))
    return tmp_path / "wandb"


def run_record(log):
    """The run record (run_id, entity, project, display_name) of a W&B transaction log: a 7-byte header
    (`:W&B`, magic, version), then 32 KiB blocks of chunks, each with a 7-byte header (CRC-32, length, type:
    1 a whole record, 2-4 the first, middle and last chunks of a split one) and a protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending = log.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", f"{log} is not a W&B transaction log"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "run":
                return record.run
    pytest.fail(f"{log} holds no run record")


def offline_runs(wandb_dir) -> list:
    """(the id in the folder's name, its run record) of each offline W&B run, oldest first."""
    folders = sorted(wandb_dir.glob("offline-run-*"))
    return [(f.name.rsplit("-", 1)[1], run_record(f / f"run-{f.name.rsplit('-', 1)[1]}.wandb")) for f in folders]


def test_a_resumed_run_continues_its_wandb_run_with_its_entity(tiny_model_dir, tmp_path, wandb_dir):
    """GRPO with --track for 2 steps, then --resume to 4: one W&B run id, kept in the run folder, used by
    both parts, each with --wandb-entity and --wandb-project (the resumed part takes them from args.json).
    Then a run folder without a kept id (from before ids were kept) resumed: a new W&B run, said in one line."""
    runs = tmp_path / "runs"
    flags = tiny_flags(model=tiny_model_dir, num_steps=2, max_new_tokens=3, eval_size=0, test_size=4, runs_dir=runs)
    started = run_script(["grpo.py", *flags, "--track", "--wandb-entity", "my-team", "--wandb-project", "rl-tests"],
                         timeout=300)
    assert started.returncode == 0, started.stderr[-3000:]
    (run_dir,) = runs.iterdir()
    run_id = (run_dir / bookkeeping.WANDB_RUN_ID).read_text().strip()
    resumed = run_script(["grpo.py", "--resume", str(run_dir), "--num-steps", "4"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [row["step"] for row in read_metrics(run_dir)[1]] == [1, 2, 3, 4]
    assert (run_dir / bookkeeping.WANDB_RUN_ID).read_text().strip() == run_id
    parts = offline_runs(wandb_dir)
    assert [name_id for name_id, _ in parts] == [run_id, run_id]  # one W&B run, continued
    for _, run in parts:
        assert (run.run_id, run.entity, run.project, run.display_name) == (run_id, "my-team", "rl-tests", run_dir.name)

    (run_dir / bookkeeping.WANDB_RUN_ID).unlink()  # a run folder from before ids were kept
    older = run_script(["grpo.py", "--resume", str(run_dir), "--num-steps", "5"], timeout=300)
    assert older.returncode == 0, older.stderr[-3000:]
    said = [line for line in older.stderr.splitlines() if "holds no W&B run id" in line]
    assert len(said) == 1 and "continue in a new W&B run" in said[0]
    new_id = (run_dir / bookkeeping.WANDB_RUN_ID).read_text().strip()  # kept, for the next --resume
    parts = offline_runs(wandb_dir)
    assert [name_id for name_id, _ in parts[:2]] == [run_id, run_id] and len(parts) == 3
    third_id, third = parts[2]
    assert new_id != run_id and third_id == third.run_id == new_id and third.entity == "my-team"


def test_without_track_wandb_is_never_imported(tiny_model_dir, tmp_path, wandb_dir):
    """wandb is installed here, but a run without --track never imports it (a slow import); -X importtime
    lists every module the run imports."""
    result = run_script(["-X", "importtime", "grpo.py", *tiny_flags(model=tiny_model_dir, max_new_tokens=3,
                                                                    eval_size=0, test_size=4, runs_dir=tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    imported = [line.rsplit("|", 1)[1].strip() for line in lines]
    assert "torch" in imported and not [name for name in imported if name.split(".")[0] == "wandb"]


@pytest.mark.parametrize("flags,mode", [(["--wandb-project", "a/b"], "offline"),  # W&B refuses the name
                                        ([], "no-such-mode")])  # WANDB_MODE that W&B's settings refuse
def test_a_failed_wandb_start_leaves_no_run_folder(flags, mode, tiny_model_dir, tmp_path, wandb_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", mode)
    runs = tmp_path / "runs"
    result = run_script(["grpo.py", *tiny_flags(model=tiny_model_dir, max_new_tokens=3, eval_size=0, test_size=4,
                                                runs_dir=runs), "--track", *flags], timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "--track=True is not allowed: W&B did not start" in error
    assert list(runs.iterdir()) == []  # RunDir.create() made runs/ and the run folder; the folder is gone
