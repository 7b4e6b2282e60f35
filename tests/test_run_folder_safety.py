"""Run folders that cannot be turned against their user: --resume of a folder from someone else's archive
never writes outside it, hostile or broken files give one line instead of a traceback or a hang, exp names
that cannot make a folder are refused before anything loads, the held-out split never leaks into training,
and a resumed run trains on the data it started with."""

import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import tyro

import bookkeeping

import common
import grpo
from conftest import ROOT, even_token_reward, script_args, subprocess_env, tiny_args

PRECIOUS = '{"step": 0, "precious": true}\n'


@pytest.fixture(scope="module")
def base_run(tiny_model_dir, tmp_path_factory) -> str:
    """A 1-step GRPO run with its checkpoint-1: resumable with --num-steps 2 (no evaluation, no reference model:
    each of the many resumes below is quick)."""
    runs = tmp_path_factory.mktemp("base") / "runs"
    args = tiny_args(grpo, model=tiny_model_dir, runs_dir=str(runs), save_every=1, eval_size=0, beta=0.0)
    return grpo.train(args, reward_fn=even_token_reward)["run_dir"]


@pytest.fixture
def run(base_run, tmp_path) -> Path:
    """A private copy of the base run, to damage."""
    copy = tmp_path / "runs" / Path(base_run).name
    shutil.copytree(base_run, copy, symlinks=True)
    return copy


def resume(run_dir, num_steps: int = 2, **flags):
    args = script_args(grpo, resume=str(run_dir), num_steps=num_steps, **flags)
    return grpo.train(args, reward_fn=even_token_reward, typed_flags={"resume", "num_steps", *flags})


def one_line(err) -> str:
    message = str(err.value if hasattr(err, "value") else err)
    assert "\n" not in message, message
    return message


def cli(argv, timeout=300, preexec_fn=None):
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=subprocess_env("1"), capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec_fn)


def refused_in_one_line(result, *words):
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    for word in words:
        assert word in line, line
    return line


# ---- 1. Symlinks in a run folder never lead a write outside it ------------------------------------------
def plant_links(run_dir: Path, names, outside: Path) -> dict:
    outside.mkdir(exist_ok=True)
    targets = {}
    for name in names:
        target = outside / name.replace("/", "_")
        if name.startswith("checkpoint-"):
            target.mkdir()
            (target / "keep").write_text(PRECIOUS)
        else:
            target.write_text(PRECIOUS)
        if os.path.lexists(run_dir / name):
            if (run_dir / name).is_dir():
                shutil.rmtree(run_dir / name)
            else:
                (run_dir / name).unlink()
        os.symlink(target, run_dir / name)
        targets[name] = target
    return targets


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_text() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def test_resume_never_writes_through_symlinks_to_files_outside_the_run_folder(run, tmp_path):
    outside = tmp_path / "outside"
    plant_links(run, [".lock", "args.json", "metrics.jsonl", "samples.jsonl"], outside)
    before = snapshot(outside)
    with pytest.raises(common.ConfigError) as err:
        resume(run)
    assert "--resume" in one_line(err) and "symbolic link" in one_line(err)
    assert snapshot(outside) == before


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "samples.jsonl", "args.json", "checkpoint-2.tmp",
                                  "checkpoint-2", "final", "final.tmp"])
def test_each_symlink_is_refused_and_nothing_outside_changes(name, run, tmp_path):
    outside = tmp_path / "outside"
    plant_links(run, [name], outside)
    before = snapshot(outside)
    with pytest.raises(common.ConfigError, match=f"--resume=.*{name.replace('.', '[.]')} is a symbolic link") as err:
        resume(run)
    one_line(err)
    assert snapshot(outside) == before


def test_temporary_files_are_made_anew_never_written_through_a_link(run, tmp_path, tiny_model_dir):
    """Past the check at --resume (a link made while the run goes on): the writers themselves never follow one.
    A rewritten file goes through a temporary name no file had; a link at checkpoint-<step>.tmp is removed,
    never what it points to; links at other names are not the run's, and stay."""
    from transformers import AutoModelForCausalLM

    outside = tmp_path / "outside"
    names = ["args.json.tmp", "metrics.jsonl.tmp", "checkpoint-2.tmp"]
    plant_links(run, names, outside)
    before = snapshot(outside)
    bookkeeping.RunLogger(str(run), script_args(grpo), common.Dist(), "grpo", resume_step=1).close()
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model_dir), common.load_tokenizer(tiny_model_dir)
    assert bookkeeping.save_checkpoint(model, tokenizer, str(run), 2, common.Dist(), state={"step": 2}, final=True)
    assert snapshot(outside) == before
    assert (run / "args.json.tmp").is_symlink() and (run / "metrics.jsonl.tmp").is_symlink()
    assert not os.path.lexists(run / "checkpoint-2.tmp") and not list(run.glob(".*.tmp"))  # nothing left over
    assert (run / "checkpoint-2" / bookkeeping.TRAINER_STATE).is_file() and (run / "args.json").is_file()
    for name in (".lock", "metrics.jsonl"):  # the files a run writes in place: refused
        (target,) = plant_links(run, [name], tmp_path / f"outside{name}").values()
        with pytest.raises(common.ConfigError, match="is a symbolic link"):
            (bookkeeping.RunDir(str(tmp_path), "x", 1, run / "checkpoint-2", common.Dist()) if name == ".lock" else
             bookkeeping.RunLogger(str(run), script_args(grpo), common.Dist(), "grpo"))
        assert target.read_text() == PRECIOUS


def test_a_run_file_is_never_written_through_its_temporary_name_and_a_users_tmp_file_stays(tmp_path, monkeypatch):
    """write_run_file (args.json, metrics.jsonl, evaluate's --details): a link at the very temporary name it
    draws (its random part fixed here) is refused, not followed; a `<name>.tmp` of the user's is kept."""
    path, outside = tmp_path / "details.jsonl", tmp_path / "outside.txt"
    path.write_text("old\n")
    outside.write_text(PRECIOUS)
    monkeypatch.setattr(bookkeeping.secrets, "token_hex", lambda n: "feedbeef")
    taken = tmp_path / ".details.jsonl.feedbeef.tmp"
    os.symlink(outside, taken)
    with pytest.raises(common.ConfigError, match=r"--details is not allowed: cannot write .*details.jsonl \(File exists"):
        bookkeeping.write_run_file(path, "new\n", "--details")
    assert outside.read_text() == PRECIOUS and path.read_text() == "old\n" and taken.is_symlink()
    monkeypatch.undo()
    (tmp_path / "details.jsonl.tmp").write_text("the user's\n")
    bookkeeping.write_run_file(path, ["new\n", "rows\n"], "--details")
    assert path.read_text() == "new\nrows\n" and (tmp_path / "details.jsonl.tmp").read_text() == "the user's\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([taken.name, path.name, outside.name,
                                                                 "details.jsonl.tmp"])

    def interrupted():  # Ctrl-C while the rows are written: the file is as it was, no temporary file is left
        yield "half\n"
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        bookkeeping.write_run_file(path, interrupted(), "--details")
    assert path.read_text() == "new\nrows\n" and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")
                                                       and p.name not in (taken.name, "details.jsonl.tmp")]


def test_a_symlinked_run_folder_or_checkpoint_is_refused(run, tmp_path):
    link = tmp_path / "link"
    os.symlink(run, link)
    with pytest.raises(common.ConfigError, match="--resume=.* is a symbolic link") as err:
        resume(link)
    one_line(err)
    real = tmp_path / "elsewhere"
    shutil.move(str(run / "checkpoint-1"), real)
    os.symlink(real, run / "checkpoint-1")
    with pytest.raises(common.ConfigError, match="--resume=.*checkpoint-1 is a symbolic link") as err:
        resume(run)
    one_line(err)


def test_a_stale_checkpoint_tmp_folder_or_a_file_in_the_way_does_not_stop_a_save(run):
    (run / "checkpoint-2.tmp").mkdir()
    (run / "checkpoint-2.tmp" / "junk").write_text("x")
    (run / "checkpoint-2").write_text("not a folder")
    resume(run)
    assert (run / "checkpoint-2" / bookkeeping.TRAINER_STATE).is_file() and not (run / "checkpoint-2.tmp").exists()


# ---- 2. A read-only run folder, and exp names that cannot make a folder ---------------------------------
def drop_root_file_powers():
    """In the child: as root, give up the capabilities that ignore file permissions (bounding set, then exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl")


def test_a_read_only_run_folder_is_one_line_naming_resume(base_run):
    top = Path(tempfile.mkdtemp())
    try:
        run_dir = top / Path(base_run).name
        shutil.copytree(base_run, run_dir)
        for path in [run_dir, *run_dir.rglob("*")]:
            path.chmod(0o555 if path.is_dir() else 0o444)
        result = cli(["grpo.py", "--resume", str(run_dir), "--num-steps", "2"],
                     preexec_fn=drop_root_file_powers if os.geteuid() == 0 else None)
        line = refused_in_one_line(result, "--resume")
        assert "not writable" in line
    finally:
        for path in [top, *top.rglob("*")]:
            path.chmod(0o755)
        shutil.rmtree(top)


@pytest.mark.parametrize("name", ["x" * 300, "é" * 130, "a\0b", ".", "..", "a/b", ""])
def test_an_exp_name_that_cannot_make_a_folder_is_refused_before_anything_loads(name, tmp_path):
    args = tiny_args(grpo, exp_name=name, model=str(tmp_path / "no-model"), runs_dir=str(tmp_path / "runs"))
    with pytest.raises(common.ConfigError, match="^--exp-name=") as err:
        grpo.train(args)
    one_line(err)
    assert not (tmp_path / "runs").exists()


def test_the_longest_exp_name_allowed_makes_folders(tmp_path):
    def allowed(n):
        try:
            bookkeeping.check_common_args(script_args(grpo, exp_name="x" * n, seed=2**31 - 1))
            return True
        except common.ConfigError:
            return False
    longest = max(n for n in range(150, 300) if allowed(n))
    assert 200 <= longest < 255 - len("__2147483647__") - 10
    for _ in range(2):  # the second folder of the same second gets a suffix
        bookkeeping.RunDir(str(tmp_path), "x" * longest, 2**31 - 1, None, common.Dist()).create()
    assert len(os.listdir(tmp_path)) == 2


# ---- 3. The held-out split never leaks into training ------------------------------------------------------
def task(a, b):
    return {"nums": [a, b], "target": a + b}


def test_duplicate_rows_never_put_held_out_tasks_into_training(tmp_path, capsys, monkeypatch):
    rows = [task(1, 2), task(90, 9), task(90, 9), task(3, 4), {"nums": [9, 1], "target": 10}, task(5, 6), task(7, 8),
            task(1, 9), task(1, 2)]  # duplicates at both ends; [9, 1] is the held-out [1, 9] reordered
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.delenv("RANK", raising=False)
    train, test = common.load_countdown(str(path), test_size=2, seed=0)
    assert test == [task(7, 8), task(1, 9)]  # the last rows after duplicates went: the first copy of each stays
    assert train == [task(1, 2), task(90, 9), task(3, 4), task(5, 6)]
    assert not {common.task_key(t) for t in train} & {common.task_key(t) for t in test}
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "2 duplicate rows" in err and "1 training row" in err, err
    monkeypatch.setenv("RANK", "1")  # other processes say nothing
    assert common.load_countdown(str(path), test_size=2, seed=0) == (train, test)
    assert capsys.readouterr().err == ""
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(json.dumps(task(i, 1)) + "\n" for i in range(1, 9)))
    monkeypatch.delenv("RANK")
    common.load_countdown(str(clean), test_size=2, seed=0)
    assert capsys.readouterr().err == ""


def test_the_hub_split_keeps_tinyzeros_rows_but_drops_training_rows_held_out(monkeypatch, capsys):
    monkeypatch.setattr(common, "TINYZERO_TRAIN_ROWS", 6)
    rows = [task(1, 2), task(3, 4), task(1, 2), {"nums": [6, 5], "target": 11}, task(7, 8), task(9, 9),
            task(5, 6), task(5, 6), task(20, 20)]
    train, test = common.split_tasks(rows, common.HUB_DATASET, 2)
    assert test == [task(5, 6), task(5, 6)]
    assert train == [task(1, 2), task(3, 4), task(1, 2), task(7, 8), task(9, 9)]
    assert "1 training row" in capsys.readouterr().err


# ---- 4. A resumed run trains on the data it started with ----------------------------------------------------
def test_args_json_records_the_data(base_run):
    saved = json.loads(Path(base_run, "args.json").read_text())
    assert saved["data_fingerprint"] == {"dataset": "generated"}


@pytest.mark.parametrize("change,what", [
    (lambda p: p.write_text(p.read_text().replace('"target": 3', '"target": 4', 1)), "sha256"),
    (lambda p: p.write_text(p.read_text() + json.dumps(task(40, 2)) + "\n"), "size"),
])
def test_a_dataset_file_changed_since_the_run_started_is_refused(change, what, tiny_model_dir, tmp_path):
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(task(i, 2)) + "\n" for i in range(1, 13)))
    args = tiny_args(grpo, model=tiny_model_dir, runs_dir=str(tmp_path / "runs"), save_every=1, eval_size=0, beta=0.0,
                     dataset=str(data))
    run_dir = grpo.train(args, reward_fn=even_token_reward)["run_dir"]
    saved = json.loads(Path(run_dir, "args.json").read_text())["data_fingerprint"]
    assert saved["size"] == data.stat().st_size and len(saved["sha256"]) == 64
    original = data.read_text()
    change(data)
    with pytest.raises(common.ConfigError, match=f"^--dataset=.* is not allowed with --resume: .*{what}") as err:
        resume(run_dir)
    one_line(err)
    data.write_text(original)  # the same bytes again: it resumes
    resume(run_dir)
    assert Path(run_dir, "checkpoint-2").is_dir()


def test_a_warm_start_remade_with_other_settings_is_refused_on_resume(tiny_model_dir, tmp_path):
    """The starting model is also the KL reference: a run begun from a warm start does not resume from one made
    with other settings in the same folder (as a rebuilt --model=bundled-warm cache would be)."""
    from test_study import load

    warm_start = load("warm_start")
    warm = tmp_path / "warm"

    def make(seed):
        warm_start.main(script_args(warm_start, out=str(warm), model=tiny_model_dir, num_steps=1, batch_size=2,
                                    seed=seed))

    make(7)
    args = tiny_args(grpo, model=str(warm), runs_dir=str(tmp_path / "runs"), save_every=1, eval_size=0)
    run_dir = grpo.train(args, reward_fn=even_token_reward)["run_dir"]
    make(8)
    with pytest.raises(common.ConfigError, match=r"^--resume=.* is not allowed: the run started from a warm start "
                                                 r"that .* no longer holds \(seed 7 -> 8\)") as err:
        resume(run_dir)
    one_line(err)
    del err  # its traceback holds the refused run's folder lock, which a process that stops releases
    gc.collect()
    assert json.loads(Path(run_dir, "args.json").read_text())["model_source"]["warm_start"]["seed"] == 7
    make(7)  # made again with the same settings (another time, perhaps another commit): it resumes
    resume(run_dir)
    assert Path(run_dir, "checkpoint-2").is_dir()


def test_a_run_from_before_fingerprints_still_resumes(run):
    saved = json.loads((run / "args.json").read_text())
    del saved["data_fingerprint"]
    (run / "args.json").write_text(json.dumps(saved))
    resume(run)
    assert "data_fingerprint" in json.loads((run / "args.json").read_text())


# ---- 5. Bool flags typed with --resume: every form --------------------------------------------------------
def test_bool_flags_with_resume_in_every_form(run):
    def attempt(*argv):
        argv = ["--resume", str(run), "--num-steps", "1", *argv]  # a finished run: accepted flags end at --num-steps
        with pytest.raises(common.ConfigError) as err:
            grpo.train(tyro.cli(grpo.Args, args=argv), typed_flags=bookkeeping.typed_flags(argv))
        return one_line(err)

    assert "raise --num-steps to continue it" in attempt("--no-gradient-checkpointing")
    assert attempt("--gradient-checkpointing").startswith(
        "--gradient-checkpointing=True is not allowed with --resume: the run was started with False")
    saved = json.loads((run / "args.json").read_text())
    (run / "args.json").write_text(json.dumps({**saved, "gradient_checkpointing": True}))
    assert "raise --num-steps to continue it" in attempt("--gradient-checkpointing")
    assert attempt("--no-gradient-checkpointing").startswith("--gradient-checkpointing=False is not allowed")
    (run / "args.json").write_text(json.dumps(saved))
    # the real command line: the form that used to be an AttributeError, and `--x=False`, which tyro refuses
    refused_in_one_line(cli(["grpo.py", "--resume", str(run), "--num-steps", "1", "--no-gradient-checkpointing"]),
                        "raise --num-steps")
    result = cli(["grpo.py", "--resume", str(run), "--gradient-checkpointing=False"])
    assert result.returncode == 2 and "Traceback" not in result.stderr and "False" in result.stderr


# ---- Other hostile run folders --------------------------------------------------------------------------
def nested(p):
    p.write_text("[" * 100000)


def wrong_type(p):
    p.write_text(json.dumps({**json.loads(p.read_text()), "learning_rate": "fast"}))


def huge(p):
    os.truncate(p, 2**34)  # a sparse 16 GiB file: reading it whole would take all the memory


@pytest.mark.parametrize("damage,message", [
    (lambda p: p.write_text("[1, 2]"), "args.json is missing or not a JSON object"),
    (nested, "args.json is missing or not a JSON object"),
    (huge, "args.json is larger than"),
    (wrong_type, "args.json holds learning_rate='fast', not a number"),
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "num_steps": 1.5})), "num_steps=1.5, not an int"),
])
def test_a_hostile_args_json_is_one_line(damage, message, run):
    damage(run / "args.json")
    with pytest.raises(common.ConfigError, match=message) as err:
        resume(run)
    one_line(err)


@pytest.mark.parametrize("name,make", [
    (".lock", lambda p: p.mkdir()),
    ("samples.jsonl", lambda p: p.mkdir()),
    ("metrics.jsonl", lambda p: p.write_text('{"step": 1}\n' + "[" * 100000 + "\n")),
])
def test_hostile_files_in_the_run_folder_are_one_line_or_harmless(name, make, run):
    path = run / name
    if path.exists():
        path.unlink()
    make(path)
    try:
        resume(run)
    except common.ConfigError as err:
        assert name in one_line(err)
    else:
        assert (run / "checkpoint-2").is_dir()


@pytest.mark.parametrize("name", ["metrics.jsonl", ".lock", "args.json", f"checkpoint-1/{bookkeeping.TRAINER_STATE}"])
def test_a_fifo_in_the_run_folder_is_refused_not_waited_on(name, run):
    path = run / name
    path.unlink()
    os.mkfifo(path)
    try:
        result = cli(["grpo.py", "--resume", str(run), "--num-steps", "2"], timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"--resume waited on the FIFO {name}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]


def test_a_checkpoint_that_is_a_file_is_ignored(run):
    (run / "checkpoint-7").write_text("not a folder")
    checkpoint, state = bookkeeping.find_checkpoint(str(run))
    assert checkpoint.name == "checkpoint-1"


def test_a_trainer_state_without_its_parts_is_one_line(run):
    import torch

    torch.save({"step": 1}, run / "checkpoint-1" / bookkeeping.TRAINER_STATE)
    with pytest.raises(common.ConfigError, match="--resume=.*trainer_state.pt") as err:
        resume(run)
    one_line(err)
