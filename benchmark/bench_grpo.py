"""Seconds per step and completion tokens per second of grpo.py (or dapo.py/ppo.py) on a fixed config.

Runs the script as a user would, reads its metrics.jsonl, and prints one JSON line: the median step time
after the first step (warm-up), completion tokens per second, and the peak RSS of the training process.
With --peer PYTHON, also runs benchmark/peer_trl_grpo.py (TRL's GRPOTrainer) with that Python on the
same settings, one after the other, so all numbers come from the same machine and moment: TRL in float32
without gradient checkpointing (as a TRL user on a CPU without bf16 units runs it, and as the scripts here
run), and with --peer-defaults also TRL's defaults (bf16, gradient checkpointing) as a labelled second
row; then the ratios per step and per completion token. The update's model FLOP/s is reported against
this machine's float32 matrix-product rate (a torch.mm on the same threads).

    python benchmark/bench_grpo.py                        # bundled model, 2 prompts x 4, 96 tokens, beta 0.04
    python benchmark/bench_grpo.py --peer /path/to/trl-venv/bin/python
    python benchmark/bench_grpo.py --script dapo.py --extra=--no-dynamic-sampling
    python benchmark/bench_grpo.py --nproc 2 --extra=--fsdp     # peak memory per process, DDP vs FSDP2
"""

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_ours(a) -> dict:
    runs = tempfile.mkdtemp(prefix="bench-runs-")
    launcher = [sys.executable] if a.nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}"]
    cmd = [*launcher, os.path.join(ROOT, a.script), "--model", a.model, "--num-steps", str(a.steps),
           "--prompts-per-step", str(a.prompts), "--group-size", str(a.G), "--max-new-tokens", str(a.max_new),
           "--beta", str(a.beta), "--learning-rate", "1e-6", "--eval-every", "0", "--eval-size", "1",
           "--save-every", "0", "--runs-dir", runs, "--micro-batch-size", str(a.micro),
           *shlex.split(a.extra)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, a.threads // a.nproc))}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before)
    (run,) = os.listdir(runs)
    rows = [json.loads(line) for line in open(os.path.join(runs, run, "metrics.jsonl"))]
    steady = rows[1:] or rows
    sps = statistics.median(r["time/step"] for r in steady)
    mean_len = statistics.mean(r["charts/response_length"] for r in steady)
    out = {"impl": a.script, "nproc": a.nproc, "micro_batch_size": a.micro, "extra": a.extra,
           "s_per_step": round(sps, 3),
           "completion_tok_per_s": round(mean_len * a.prompts * a.G / sps, 1), "mean_len": round(mean_len, 1),
           "generation_s": round(statistics.median(r["time/generation"] for r in steady), 3),
           "update_s": round(statistics.median(r["time/update"] for r in steady), 3),
           "peak_rss_mb": peak // 1024}  # the largest single process (per process under torchrun)
    for key in ("charts/generation_batches", "time/regeneration", "time/weight_sync"):
        if key in steady[0]:
            out[key] = round(statistics.mean(r[key] for r in steady), 3)
    return out


def update_rate(a, ours: dict) -> dict:
    """The update's model FLOP/s (benchmark/flops.py) and its share of this CPU's float32 matmul rate."""
    import torch

    sys.path.insert(0, ROOT)
    import common
    from flops import matmul_tflops, update_flops

    torch.set_num_threads(a.threads)
    path = common.resolve_model(a.model)
    tokenizer = common.load_tokenizer(path)
    tasks = common.generate_tasks(32, 0)
    prompt_tokens = sum(len(tokenizer(common.make_prompt(tokenizer, t), add_special_tokens=False).input_ids)
                        for t in tasks) / len(tasks)
    # grpo.py/dapo.py defaults: one epoch of 2 minibatches (old log-probs needed), a reference when beta > 0
    passes = {"train": 1, "forward": 1 + int(a.beta > 0)}
    flops = update_flops(path, a.prompts * a.G, prompt_tokens, ours["mean_len"], passes)
    rate = matmul_tflops("cpu", torch.float32, n=2048, repeats=10)
    achieved = flops / ours["update_s"] / 1e12
    return {"update_tflop": round(flops / 1e12, 2), "update_tflops": round(achieved, 3),
            "matmul_tflops": round(rate, 3), "update_share_of_matmul_rate": round(achieved / rate, 2)}


def run_peer(a, trl_defaults: bool = False) -> dict:
    peer = os.path.join(ROOT, "benchmark", "peer_trl_grpo.py")
    cmd = [a.peer, peer, a.model, "--steps", str(a.steps), "--G", str(a.G), "--prompts", str(a.prompts),
           "--max-new", str(a.max_new), "--threads", str(a.threads)] + (["--trl-defaults"] if trl_defaults else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", default="grpo.py")
    p.add_argument("--model", default="bundled")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--G", type=int, default=4)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--micro", type=int, default=2, help="--micro-batch-size of the script")
    p.add_argument("--nproc", type=int, default=1, help="processes under torchrun (threads are split)")
    p.add_argument("--extra", default="", help="more flags for the script")
    p.add_argument("--peer", default=None, help="a Python with trl installed: also run TRL's GRPOTrainer")
    p.add_argument("--peer-defaults", action="store_true", help="also TRL with its defaults (bf16, recomputation)")
    a = p.parse_args()
    ours = run_ours(a)
    ours.update(update_rate(a, ours))
    print(json.dumps(ours), flush=True)
    if a.peer:
        for defaults in (False, True) if a.peer_defaults else (False,):
            peer = run_peer(a, defaults)
            peer["config"] = "TRL defaults (bf16, gradient checkpointing)" if defaults else "float32, no recomputation"
            print(json.dumps(peer), flush=True)
            per_token = round(ours["completion_tok_per_s"] / peer["completion_tok_per_s"], 2)
            print(json.dumps({"ratio": f"{a.script} vs TRL, {peer['config']}",
                              "per_step": round(peer["s_per_step"] / ours["s_per_step"], 2),
                              "per_completion_token": per_token}), flush=True)


if __name__ == "__main__":
    main()
