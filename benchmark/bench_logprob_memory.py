"""Peak memory and time of one forward + backward of the log-prob pass (common.completion_logprobs with
entropy), with the whole (B, T, vocab) logits (chunk 0, as most trainers do) and chunked (the default).

The model has Qwen2.5's vocabulary (151,936) on a tiny body (2 layers, hidden 64), so the output layer
dominates, as it does for the paper's shapes. Each setting runs in a fresh process; on a CPU the figure is
the peak resident memory above what the process held before the pass, on a GPU the peak allocated.

    python benchmark/bench_logprob_memory.py                      # T = 1024, micro-batch 8, CPU
    python benchmark/bench_logprob_memory.py --device cuda --hidden 1536 --layers 28   # Qwen2.5-1.5B's shape
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import common  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(a) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = torch.device(a.device)
    config = Qwen2Config(vocab_size=151936, hidden_size=a.hidden,
                         intermediate_size=a.hidden * 4 if a.hidden < 1000 else 8960,
                         num_hidden_layers=a.layers, num_attention_heads=max(2, a.hidden // 128),
                         num_key_value_heads=2 if a.hidden >= 256 else 1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = common.autocast_forward(Qwen2ForCausalLM(config).to(device), common.compute_dtype("auto", device))
    if a.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompt = torch.randint(0, 151936, (a.batch, a.prompt), device=device)
    completion = torch.randint(0, 151936, (a.batch, a.length), device=device)
    ones_p, ones_c = torch.ones_like(prompt), torch.ones_like(completion)
    for _ in range(2):  # warm-up, then the measured pass
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            before = rss_bytes()
        start = time.perf_counter()
        logprobs, entropy = common.completion_logprobs(model, prompt, ones_p, completion, ones_c, 1.0,
                                                       with_entropy=True, chunk=a.chunk)
        (logprobs.mean() + 0 * entropy.mean()).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        seconds = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        del logprobs, entropy
    return {"chunk": a.chunk, "batch": a.batch, "completion_tokens": a.length, "prompt_tokens": a.prompt,
            "vocab": 151936, "hidden": a.hidden, "layers": a.layers, "device": a.device,
            "peak_extra_gib": round(peak / 2**30, 3), "seconds": round(seconds, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024, help="completion tokens")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, common.LOGPROB_CHUNK],
                        help="settings to compare (0: whole logits)")
    parser.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)  # the child process's setting
    parser.add_argument("--out", default="", help="also append the JSON lines to this file")
    a = parser.parse_args()
    if a.chunk is not None:
        print(json.dumps(child(a)))
        return 0
    results = []
    for chunk in a.chunks:  # the ru_maxrss high-water mark is per process: one process per setting
        cmd = [sys.executable, __file__, "--chunk", str(chunk)] + [
            x for k, v in vars(a).items() if k not in ("chunk", "chunks", "out", "gradient_checkpointing")
            for x in (f"--{k.replace('_', '-')}", str(v))
        ] + (["--gradient-checkpointing"] if a.gradient_checkpointing else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            line = json.dumps({"chunk": chunk, "error": proc.stderr.strip().splitlines()[-1][:200]})
        else:
            line = proc.stdout.strip().splitlines()[-1]
            results.append(json.loads(line))
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")
    if len(results) >= 2 and results[0]["chunk"] == 0:
        for r in results[1:]:
            print(f"chunk {r['chunk']}: {results[0]['peak_extra_gib'] / max(r['peak_extra_gib'], 1e-9):.1f}x less peak "
                  f"memory than whole logits ({results[0]['peak_extra_gib']} -> {r['peak_extra_gib']} GiB), "
                  f"{r['seconds']} s vs {results[0]['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
