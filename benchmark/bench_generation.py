"""Completion tokens per second of the generation backends on one workload (issue: vLLM vs HF).

Each backend runs in its own process (the in-process vLLM engine pins torch's threads), samples a
short warm-up, then the workload --repeat times, and prints one JSON line (the last run's numbers).

    python benchmark/bench_generation.py                      # bundled model, 8 prompts x 8, 256 tokens
    python benchmark/bench_generation.py --backends hf        # HF generate only
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(a) -> dict:
    sys.path.insert(0, ROOT)
    import torch

    import bookkeeping
    import common
    import grpo

    world = common.Dist()
    path = common.resolve_model(a.model)
    tokenizer = common.load_tokenizer(path)
    model = common.load_model(path, world.device)
    args = bookkeeping.build_args(grpo.Args, backend=a.backend, max_new_tokens=a.max_new, seed=0)
    start = time.perf_counter()
    backend = common.make_backend(a.backend, model, tokenizer, args.system, args.task, args.seed, path, world)
    startup = time.perf_counter() - start
    prompts = [common.make_prompt(tokenizer, t) for t in common.generate_tasks(a.prompts, 1)]
    backend.generate(prompts[:1], 2, 8, 1.0, seed=1)  # warm-up
    runs = []
    for repeat in range(a.repeat):  # the first full-size call can pay for memory the later ones reuse
        start = time.perf_counter()
        rollout = backend.generate(prompts, a.G, a.max_new, 1.0, seed=2 + repeat)
        seconds = time.perf_counter() - start
        runs.append((rollout.completion_lengths.sum().item(), seconds))
    tokens, seconds = runs[-1]
    return {"backend": a.backend, "prompts": a.prompts, "G": a.G, "max_new_tokens": a.max_new,
            "completion_tokens": tokens, "seconds": round(seconds, 2), "tok_per_s": round(tokens / seconds, 1),
            "tok_per_s_each_run": [round(n / s, 1) for n, s in runs],
            "startup_s": round(startup, 1), "threads": torch.get_num_threads()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bundled")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2, help="timed runs; the last one is reported")
    p.add_argument("--backends", default="hf,vllm")
    p.add_argument("--backend", help=argparse.SUPPRESS)  # set in the child process
    a = p.parse_args()
    if a.backend:
        print(json.dumps(measure(a)), flush=True)
        return
    for backend in a.backends.split(","):
        cmd = [sys.executable, __file__, "--backend", backend, "--model", a.model, "--prompts", str(a.prompts),
               "--G", str(a.G), "--max-new", str(a.max_new), "--repeat", str(a.repeat)]
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
