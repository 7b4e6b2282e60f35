"""Helpers that read what the user or a crash left on disk: checkpoint checks that do not unpickle the
optimizer state, model folders (shard index, tokenizer), the bundled-model cache, and the TRL peer's reward.
Hostile inputs get one line (a ConfigError) or are skipped as damaged, never a traceback, hang or leak."""

import ast
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import bookkeeping

import common
import countdown_reward
import evaluate
from conftest import ROOT, checkpoint_weights


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# ---- 1. Evaluating a run checks its checkpoint without loading the optimizer state ---------------------------
def write_checkpoint(path: Path, step: int, model_dir: str | None = None) -> Path:
    """A checkpoint as save_checkpoint writes it: weights (the tiny model, or one tensor), a trainer state."""
    if model_dir:
        shutil.copytree(model_dir, path)
    else:
        path.mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))
    torch.save({"step": step, "optimizer": {"exp_avg": torch.randn(4096)}}, path / bookkeeping.TRAINER_STATE)
    return path


@pytest.fixture
def no_torch_load(monkeypatch):
    """A spy: the cheap check must not unpickle anything."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch.load was called")
    monkeypatch.setattr(torch, "load", refuse)


def truncate_to(size):
    return lambda p: os.truncate(p, size(p.stat().st_size))


def flip_pickle_byte(path: Path):
    """One byte of data.pkl changed: the archive's structure holds, its CRC does not."""
    import struct
    import zipfile

    info = next(i for i in zipfile.ZipFile(path).infolist() if i.filename.endswith("/data.pkl"))
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    data[info.header_offset + 30 + name_len + extra_len + 5] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [
    truncate_to(lambda n: 0), truncate_to(lambda n: 100), truncate_to(lambda n: n // 2), truncate_to(lambda n: n - 1),
    lambda p: p.write_bytes(b"not a zip archive at all" * 100), flip_pickle_byte,
    lambda p: (p.unlink(), os.mkfifo(p)), lambda p: (p.unlink(), p.mkdir()),
    lambda p: (p.unlink(), p.symlink_to("/etc/passwd")), lambda p: (p.unlink(), p.symlink_to("/dev/zero")),
], ids=["empty", "100-bytes", "half", "last-byte", "garbage", "pickle-crc", "fifo", "folder", "link-to-passwd",
        "link-to-dev-zero"])
def test_the_cheap_check_finds_a_damaged_trainer_state_without_unpickling(damage, tmp_path, no_torch_load):
    write_checkpoint(tmp_path / "checkpoint-1", 1)
    damage(write_checkpoint(tmp_path / "checkpoint-2", 2) / bookkeeping.TRAINER_STATE)
    found = bookkeeping.complete_checkpoints(tmp_path)
    assert bookkeeping.newest_intact_checkpoint(found, load_state=False) == (tmp_path / "checkpoint-1", None)


@pytest.mark.parametrize("damage", [
    lambda p: (p.unlink(), os.mkfifo(p)), lambda p: os.truncate(p, 300), flip_pickle_byte,
    lambda p: (p.unlink(), p.symlink_to("/dev/zero")),
], ids=["fifo", "truncated", "pickle-crc", "link-to-dev-zero"])
def test_resume_skips_a_damaged_trainer_state(damage, tmp_path):
    """Damage falls back to the checkpoint before (a damaged pickle was refused as if crafted, or hung)."""
    write_checkpoint(tmp_path / "checkpoint-1", 1)
    damage(write_checkpoint(tmp_path / "checkpoint-2", 2) / bookkeeping.TRAINER_STATE)
    start = time.perf_counter()
    checkpoint, state = bookkeeping.find_checkpoint(str(tmp_path))
    assert checkpoint.name == "checkpoint-1" and state["step"] == 1 and time.perf_counter() - start < 10


class RunsCode:
    def __reduce__(self):
        return (os.system, ("exit 1",))


def test_resume_still_refuses_a_crafted_trainer_state(tmp_path, monkeypatch):
    write_checkpoint(tmp_path / "checkpoint-1", 1)
    newest = write_checkpoint(tmp_path / "checkpoint-2", 2)
    torch.save({"step": 2, "payload": RunsCode()}, newest / bookkeeping.TRAINER_STATE)
    ran = []
    monkeypatch.setattr(os, "system", lambda *a: ran.append(a))
    with pytest.raises(common.ConfigError, match="refused to load it"):
        bookkeeping.find_checkpoint(str(tmp_path))
    assert ran == []
    assert bookkeeping.newest_intact_checkpoint(bookkeeping.complete_checkpoints(tmp_path),
                                                load_state=False)[0].name == \
        "checkpoint-2"  # evaluate.py never unpickles it, and scores the weights


def test_the_cheap_check_finds_damaged_or_missing_weights(tmp_path, no_torch_load):
    write_checkpoint(tmp_path / "checkpoint-1", 1)
    newest = write_checkpoint(tmp_path / "checkpoint-2", 2)
    os.truncate(newest / "model.safetensors", 50)
    found = bookkeeping.complete_checkpoints(tmp_path)
    assert bookkeeping.newest_intact_checkpoint(found, load_state=False)[0].name == "checkpoint-1"
    (newest / "model.safetensors").unlink()
    assert bookkeeping.newest_intact_checkpoint(found, load_state=False)[0].name == "checkpoint-1"


def test_evaluate_picks_a_runs_checkpoint_without_loading_its_optimizer_state(tiny_model_dir, tmp_path, monkeypatch):
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoint-1", 1, tiny_model_dir)
    write_checkpoint(run / "checkpoint-2", 2, tiny_model_dir)
    (run / "args.json").write_text(json.dumps({"test_size": 8}))
    os.truncate(run / "checkpoint-2" / bookkeeping.TRAINER_STATE, 1000)
    assert bookkeeping.find_checkpoint(str(run))[1]["step"] == 1  # resume still loads (and needs) the state
    with monkeypatch.context() as m:
        m.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
        assert evaluate.resolve_target(str(run)) == (str(run / "checkpoint-1"), {"test_size": 8}, 1)
        (run / "checkpoint-1" / "config.json").unlink()  # a checkpoint transformers cannot load: one line
        with pytest.raises(common.ConfigError, match="target=.*checkpoint-1.* no config.json") as err:
            evaluate.resolve_target(str(run))
    one_line(err)


@pytest.mark.parametrize("name,message", [
    ("checkpoint-final", None),  # not a step: evaluated, with no step
    ("checkpoint-\u00b2", None),  # a digit to str.isdigit, not to int()
    ("checkpoint-3.tmp", "half-written"),
])
def test_evaluate_takes_odd_checkpoint_names_in_a_run(name, message, tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    write_checkpoint(run / name, 3, tiny_model_dir)
    (run / "args.json").write_text("{}")
    if message is None:
        assert evaluate.resolve_target(str(run / name)) == (str(run / name), {}, None)
        return
    with pytest.raises(common.ConfigError, match=f"target=.* is not allowed: .*{message}") as err:
        evaluate.resolve_target(str(run / name))
    one_line(err)


def test_a_deeply_nested_args_json_is_one_line(tmp_path):
    (tmp_path / "args.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(common.ConfigError, match="args.json is not a JSON object") as err:
        evaluate.resolve_target(str(tmp_path))
    one_line(err)


# ---- 2. Model folders: the shard index is read, and a tokenizer needs a vocabulary ----------------------------
def sharded_copy(tiny_model_dir: str, path: Path) -> Path:
    """The tiny model as transformers writes a large one: two shards and model.safetensors.index.json."""
    shutil.copytree(tiny_model_dir, path, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = checkpoint_weights(tiny_model_dir)
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(path / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    return path


def test_a_sharded_model_folder_is_checked_and_loads(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    path = sharded_copy(tiny_model_dir, tmp_path / "sharded")
    common.check_model_folder(str(path))
    AutoModelForCausalLM.from_pretrained(str(path))  # the hand-made shards are what transformers reads


def set_index(change):
    def damage(path: Path):
        index = json.loads((path / "model.safetensors.index.json").read_text())
        change(index, path)
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return damage


def move_shard(target: str):
    """The index names `target` for the second shard, and the shard is moved there."""
    def change(index, path):
        shard = "model-00002-of-00002.safetensors"
        dest = (path / target).resolve()
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(path / shard, dest)
        index["weight_map"] = {k: (target if v == shard else v) for k, v in index["weight_map"].items()}
    return set_index(change)


SHARD = "model-00002-of-00002.safetensors"


def fifo(path: Path):
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize("damage,message", [
    (lambda p: (p / SHARD).unlink(), f"names {SHARD}, which is missing"),
    (lambda p: os.truncate(p / SHARD, 500), f"{SHARD} is damaged"),
    (lambda p: (p / "model.safetensors.index.json").write_text("{not json"), "is not a shard index"),
    (lambda p: (p / "model.safetensors.index.json").write_text("[1, 2]"), "is not a shard index"),
    (set_index(lambda i, p: i.update(weight_map=["a"])), "is not a shard index"),
    (set_index(lambda i, p: i.update(weight_map={})), "is not a shard index"),
    (set_index(lambda i, p: i.update(weight_map={"x": 3})), "is not a shard index"),
    (move_shard("../outside.safetensors"), "outside the folder"),
    (move_shard("sub/model-2.safetensors"), "outside the folder"),
    (move_shard("sub\\model-2.safetensors"), "outside the folder"),
    (set_index(lambda i, p: i["weight_map"].update(extra=str(p / SHARD))), "outside the folder"),
    (set_index(lambda i, p: i["weight_map"].update(extra="")), "outside the folder"),
    (set_index(lambda i, p: i["weight_map"].update(extra="..")), "outside the folder"),
    (set_index(lambda i, p: i["weight_map"].update(extra="model-00001-of-00002.safetensors")), "does not hold"),
    (lambda p: ((p / SHARD).unlink(), (p / SHARD).symlink_to("/etc/passwd")), f"{SHARD} is damaged"),
    (lambda p: ((p / SHARD).unlink(), (p / SHARD).mkdir()), f"{SHARD} is not a file"),
    (lambda p: fifo(p / "model.safetensors.index.json"), "is not a shard index"),
    (lambda p: (p / "model.safetensors.index.json").write_text("[" * 100000 + "]" * 100000), "is not a shard index"),
    (set_index(lambda i, p: i["weight_map"].update(extra="a\0b.safetensors")), "which is missing"),
], ids=["missing", "truncated", "not-json", "a-list", "map-a-list", "map-empty", "map-value-int", "dotdot-path",
        "subfolder", "backslash", "absolute", "empty-name", "dotdot-name", "tensor-not-in-shard", "link-to-passwd",
        "a-folder", "index-fifo", "index-deep", "nul-in-name"])
def test_a_damaged_shard_index_is_one_line(damage, message, tiny_model_dir, tmp_path):
    path = sharded_copy(tiny_model_dir, tmp_path / "model")
    damage(path)
    with pytest.raises(common.ConfigError, match=f"--model=.* is not allowed: .*{message}") as err:
        common.check_model_folder(str(path))
    one_line(err)


def test_a_sharded_checkpoint_missing_a_shard_is_damaged(tiny_model_dir, tmp_path):
    write_checkpoint(tmp_path / "checkpoint-1", 1)
    newest = sharded_copy(tiny_model_dir, tmp_path / "checkpoint-2")
    torch.save({"step": 2}, newest / bookkeeping.TRAINER_STATE)
    found = bookkeeping.complete_checkpoints(tmp_path)
    assert bookkeeping.newest_intact_checkpoint(found)[0].name == "checkpoint-2"
    (newest / SHARD).unlink()
    for load_state in (True, False):
        assert bookkeeping.newest_intact_checkpoint(found, load_state=load_state)[0].name == "checkpoint-1"




@pytest.mark.parametrize("damage,message", [
    (lambda p: [(p / f).unlink() for f in ("tokenizer.json",)], "the folder has no tokenizer"),
    (lambda p: ((p / "tokenizer.json").unlink(), (p / "tokenizer.json").mkdir()), "the folder has no tokenizer"),
    (lambda p: fifo(p / "tokenizer.json"), "the folder has no tokenizer"),
    (lambda p: os.truncate(p / "tokenizer.json", 100000), "tokenizer.json is damaged"),
    (lambda p: ((p / "tokenizer.json").unlink(), (p / "tokenizer.json").symlink_to("/etc/passwd")),
     "tokenizer.json is damaged"),
    (lambda p: (p / "config.json").write_text("[1, 2]"), "config.json is not JSON"),
    (lambda p: (p / "config.json").write_text('{"model_type": 3}'), "names no model_type"),
    (lambda p: (p / "config.json").write_text("[" * 100000 + "]" * 100000), "config.json is not JSON"),
    (lambda p: (p / "config.json").write_bytes(b"\xff\xfe{}"), "config.json is not JSON"),
    (lambda p: ((p / "model.safetensors").unlink(), (p / "model.safetensors").symlink_to("/etc/passwd")),
     "model.safetensors is damaged"),
    (lambda p: fifo(p / "model.safetensors"), "model.safetensors is not a file"),
    (lambda p: ((p / "model.safetensors").unlink(), (p / "model.safetensors").mkdir()),
     "model.safetensors is not a file"),
    (lambda p: ((p / "model.safetensors").rename(p / "training_args.bin")), "the folder has no weights"),
    (lambda p: ((p / "model.safetensors").rename(p / "optimizer.safetensors")), "the folder has no weights"),
], ids=["tokenizer-config-only", "tokenizer-json-a-folder", "tokenizer-json-fifo", "tokenizer-json-truncated",
        "tokenizer-json-link-to-passwd", "config-a-list", "model-type-int", "config-deep",
        "config-not-utf8", "weights-link-to-passwd", "weights-fifo", "weights-a-folder", "only-training-args-bin",
        "only-optimizer-safetensors"])
def test_a_hostile_model_folder_is_one_line(damage, message, tiny_model_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(path))
    assert not {"tokenizer.model", "vocab.json"} & set(os.listdir(path))
    damage(path)
    start = time.perf_counter()
    with pytest.raises(common.ConfigError, match=f"--model=.* is not allowed: .*{message}") as err:
        common.check_model_folder(str(path))
    assert time.perf_counter() - start < 10
    one_line(err)


# ---- 3. The bundled-model cache --------------------------------------------------------------------------------
ENTRY = "SmolLM2-135M-Instruct"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("RL_COUNTDOWN_CACHE", str(path))
    return path


@pytest.fixture
def convert(tiny_model_dir, monkeypatch):
    """The 25-second GGUF conversion replaced by a copy of the tiny model; counts its calls."""
    calls = []

    def fake(src, out):
        calls.append(out)
        shutil.copytree(tiny_model_dir, out)
    monkeypatch.setattr(common, "_convert_bundled", fake, raising=False)
    return calls


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if ".tmp" in p.name)


@pytest.mark.parametrize("broken", [
    lambda e, model: (e.mkdir(), (e / "model.safetensors").write_bytes(b"x" * 1000)),  # no config.json
    lambda e, model: e.write_text("a file"),
    lambda e, model: (shutil.copytree(model, e), os.truncate(e / "model.safetensors", 100)),  # damaged weights
], ids=["no-config", "a-file", "damaged-weights"])
def test_a_broken_cache_entry_is_rebuilt_once_and_leaves_no_temporary_folder(broken, cache, convert, tiny_model_dir):
    cache.mkdir()
    (cache / f"{ENTRY}.tmp99999").mkdir()  # left by a build that was killed
    (cache / f"{ENTRY}.tmp99999" / "model.safetensors").write_bytes(b"x" * 1000)
    (cache / f"{ENTRY}.tmp-notes.txt").write_text("not a build's")  # a cache set to a shared folder: kept
    broken(cache / ENTRY, tiny_model_dir)
    assert common.bundled_model_dir() == str(cache / ENTRY)
    common.check_model_folder(str(cache / ENTRY))
    assert common.bundled_model_dir() == str(cache / ENTRY)
    assert len(convert) == 1 and leftovers(cache) == [f"{ENTRY}.tmp-notes.txt"]


def test_a_failed_build_removes_its_temporary_folder_and_is_one_line(cache, monkeypatch):
    def disk_full(src, out):
        os.makedirs(out)
        (Path(out) / "model.safetensors").write_bytes(b"x" * 1000)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(common, "_convert_bundled", disk_full, raising=False)
    with pytest.raises(common.ConfigError, match=f"RL_COUNTDOWN_CACHE.*{cache}|{cache}.*RL_COUNTDOWN_CACHE") as err:
        common.bundled_model_dir()
    assert "No space left" in one_line(err)
    assert leftovers(cache) == [] and not (cache / ENTRY).exists()


@pytest.mark.parametrize("make_dir", [common.bundled_model_dir, common.warm_started_model_dir])
@pytest.mark.parametrize("setting", ["file", "under-a-file", "proc", "home-file", "home-proc"])
def test_a_cache_path_that_cannot_be_a_folder_is_one_line(setting, make_dir, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    path = {"file": tmp_path / "file", "under-a-file": tmp_path / "file" / "cache", "proc": Path("/proc/rl-cache"),
            "home-file": tmp_path / "file", "home-proc": Path("/proc/rl-home")}[setting]
    if setting.startswith("home"):
        monkeypatch.delenv("RL_COUNTDOWN_CACHE", raising=False)
        monkeypatch.setenv("HOME", str(path))
    else:
        monkeypatch.setenv("RL_COUNTDOWN_CACHE", str(path))
    with pytest.raises(common.ConfigError, match="RL_COUNTDOWN_CACHE") as err:
        make_dir()
    assert str(path) in one_line(err)


def test_an_empty_cache_variable_means_the_default_and_a_tilde_is_home(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_COUNTDOWN_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert common.cache_root() == tmp_path / ".cache" / "rl-countdown"
    monkeypatch.setenv("RL_COUNTDOWN_CACHE", "~/models")
    assert common.cache_root() == tmp_path / "models" and (tmp_path / "models").is_dir()


@pytest.mark.parametrize("name", [ENTRY, f"{ENTRY}-warm-start"])
def test_a_cache_entry_linked_outside_the_cache_is_refused(name, cache, convert, tiny_model_dir, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(tiny_model_dir, outside)
    cache.mkdir()
    (cache / name).symlink_to(outside)
    make_dir = common.bundled_model_dir if name == ENTRY else common.warm_started_model_dir
    with pytest.raises(common.ConfigError, match=f"RL_COUNTDOWN_CACHE.*{name} is a symlink .*outside") as err:
        make_dir()
    one_line(err)
    assert sorted(os.listdir(outside)) == sorted(os.listdir(tiny_model_dir)) and convert == []


def test_a_cache_entry_linked_inside_the_cache_is_used(cache, convert, tiny_model_dir):
    cache.mkdir()
    shutil.copytree(tiny_model_dir, cache / "v2")
    (cache / ENTRY).symlink_to(cache / "v2")
    assert common.bundled_model_dir() == str(cache / ENTRY) and convert == []


@pytest.mark.parametrize("lock", [".bundled.lock", ".warm_start.lock"])
def test_a_lock_file_linked_elsewhere_is_refused_not_truncated(lock, cache, convert, tmp_path):
    (tmp_path / "precious").write_text("keep me")
    cache.mkdir()
    (cache / lock).symlink_to(tmp_path / "precious")
    with pytest.raises(common.ConfigError, match=f"RL_COUNTDOWN_CACHE.*{lock} is a symlink") as err:
        common.bundled_model_dir()
    one_line(err)
    assert (tmp_path / "precious").read_text() == "keep me" and convert == []


# ---- 4. The TRL peer scores completions with the project's reward, never with eval ------------------------------
PEER = os.path.join(ROOT, "benchmark", "peer_trl_grpo.py")


def peer_module():
    spec = importlib.util.spec_from_file_location("peer_trl_grpo", PEER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # without trl installed: trl is imported when the benchmark runs
    return module


def test_the_peer_never_calls_eval():
    calls = [n for n in ast.walk(ast.parse(Path(PEER).read_text())) if isinstance(n, ast.Call)]
    assert not [c for c in calls if isinstance(c.func, ast.Name) and c.func.id in ("eval", "exec", "compile")]


def test_the_peer_reward_is_the_projects_and_hostile_answers_return_at_once(monkeypatch):
    peer = peer_module()
    monkeypatch.setattr("builtins.eval", lambda *a, **k: pytest.fail("eval was called"))
    nums, target = [3, 4, 5], 17
    texts = [
        "<think>x</think> <answer>3 * 4 + 5</answer>", "<think>x</think> <answer>3 + 4 + 5</answer>",
        "<answer>3 * 4 + 5</answer>", "<think>x</think> <answer>9**9**9**9</answer>",
        "<think>x</think> <answer>3**4**5</answer>", "<think>x</think> <answer>" + "(" * 50000 + "3",
        "<think>x</think> <answer>" + "9" * 100000 + "</answer>", "<think>x</think> <answer>__import__('os')</answer>",
        "<think>x</think> <answer>" + "(" * 5000 + "3*4+5" + ")" * 5000 + "</answer>", "",
    ]
    start = time.perf_counter()
    as_messages = peer.reward([[{"role": "assistant", "content": t}] for t in texts], [nums] * len(texts),
                              [target] * len(texts))
    as_text = peer.reward(texts, [nums] * len(texts), [target] * len(texts))
    assert time.perf_counter() - start < 2
    expected = [countdown_reward.compute_score(t, nums, target, format_score=0.1, score=1.0) for t in texts]
    assert as_messages == as_text == expected
    assert expected[:5] == [1.0, 0.1, 0.0, 0.1, 0.1]
