"""A sharded checkpoint (written by an --fsdp run under torchrun: weights and AdamW states in
checkpoint-<step>/sharded/, torch.distributed.checkpoint) as a plain HF model folder that transformers, vLLM,
lm-eval and evaluate.py load: the policy's weights alone, in float32 (default) or bfloat16. One process, no
torchrun; it holds the whole model on the CPU.

    python tools/consolidate.py runs/grpo__1__1764000000/checkpoint-20 --out consolidated-20
    python tools/consolidate.py runs/grpo__1__1764000000/checkpoint-20 --out c20-bf16 --dtype bfloat16
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bookkeeping  # noqa: E402
import common  # noqa: E402


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint-<step> folder of an --fsdp run")
    parser.add_argument("--out", required=True, help="the new model folder (must not exist)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the weights' dtype (float32: the trained weights bit for bit)")
    args = parser.parse_args(argv)
    out = bookkeeping.consolidate_checkpoint(args.checkpoint, args.out, getattr(torch, args.dtype))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    common.run_command(main)
