"""Where a training step's time and tokens go, read from finished runs' own records (nothing is run).

For each variant (experiment folder / a run folder's name before `__seed__`): the median seconds per step of
generation, of the update (old, reference and policy log-probs, backward, optimizer) and of the whole step,
and the mean completion length with its stop token (`charts/response_length`), from metrics.jsonl; the mean
prompt length of the logged training samples (samples.jsonl), encoded by common.encode_prompts (the bundled
model's tokenizer, chat template included). The update's forward and backward passes run over prompt and
completion alike.

    python benchmark/step_breakdown.py study/results/cpu/algorithms/*__* study/results/cpu/group-size/G4__*
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from statistics import fmean, median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from plot import read_rows  # noqa: E402


def prompt_tokens(run: Path, tokenizer) -> list[int]:
    """Token counts of the run's logged training prompts, encoded by the scripts' own common.encode_prompts."""
    prompts = [json.loads(line)["prompt"] for line in (run / "samples.jsonl").read_text().splitlines()]
    _, mask = common.encode_prompts(tokenizer, prompts, 1, "cpu")
    return mask.sum(dim=1).tolist()


def breakdown(runs: list[Path], tokenizer) -> dict[str, dict]:
    """Per variant: its runs, steps, median seconds of generation, update and step, mean tokens per sample."""
    by_variant = defaultdict(lambda: defaultdict(list))
    for run in runs:
        rows = [row for row in read_rows(run) if "time/update" in row]  # training steps, not evaluations
        variant = by_variant[f"{run.parent.name}/{run.name.split('__')[0]}"]
        variant["runs"].append(run.name)
        for key in ("time/generation", "time/update", "time/step", "charts/response_length"):
            variant[key] += [row[key] for row in rows]
        variant["prompt"] += prompt_tokens(run, tokenizer)
    return {name: dict(runs=len(v["runs"]), steps=len(v["time/step"]), generation=median(v["time/generation"]),
                       update=median(v["time/update"]), step=median(v["time/step"]), prompt=fmean(v["prompt"]),
                       completion=fmean(v["charts/response_length"]))
            for name, v in by_variant.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (metrics.jsonl and samples.jsonl inside)")
    parser.add_argument("--tokenizer", default="bundled", help="model whose tokenizer counts the tokens")
    args = parser.parse_args()
    tokenizer = common.load_tokenizer(common.resolve_model(args.tokenizer))
    print("| variant | runs | steps | generation s | update s | step s | update share | prompt tokens "
          "| completion tokens | prompt share |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, v in breakdown(args.runs, tokenizer).items():
        print(f"| {name} | {v['runs']} | {v['steps']} | {v['generation']:.1f} | {v['update']:.1f} | {v['step']:.1f} "
              f"| {v['update'] / v['step']:.0%} | {v['prompt']:.1f} | {v['completion']:.1f} "
              f"| {v['prompt'] / (v['prompt'] + v['completion']):.0%} |")


if __name__ == "__main__":
    main()
