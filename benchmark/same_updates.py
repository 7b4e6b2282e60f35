"""Does a refactor keep every update identical? Trains the same tiny runs with the code of another commit and
with this tree, and compares the final weights bit for bit (and the logged metrics).

    python benchmark/same_updates.py --before 08cfe48

Each script runs 3 steps on a random 2-layer model with SmolLM2's tokenizer, from its train() with a reward
that varies deterministically with the text (the crc32 of each completion), so that advantages are non-zero
without a model that can solve Countdown, and learning rate 1e-3 so that clipping acts after the first optimizer
step: GRPO with 2 epochs; DAPO with dynamic sampling, overlong shaping, an entropy bonus, a KL term and 2
minibatches; PPO with a critic warm-up and an entropy bonus. Flags go through tyro, so any Args
layout of either commit reads them. Prints one JSON line per script, with both commits (`before` as given and
resolved, `after`: this tree's commit and whether its code differs from it); exit 1 if any weights differ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ("--num-steps 3 --prompts-per-step 4 --max-new-tokens 16 --eval-size 4 --test-size 8 --eval-every 2 "
          "--save-every 0 --task-operators +-*/ --micro-batch-size 3 --learning-rate 1e-3").split()
SCRIPTS = {
    "grpo": "--group-size 4 --update-epochs 2".split(),
    "dapo": ("--group-size 4 --dynamic-sampling --max-generation-batches 3 --overlong-buffer 4 --ent-coef 0.01 "
             "--beta 0.01 --num-minibatches 2").split(),
    "ppo": "--group-size 1 --critic-warmup-steps 1 --ent-coef 0.01".split(),
}
DRIVER = """
import sys, zlib, importlib, tyro
sys.path.insert(0, ".")
module = importlib.import_module(sys.argv[1])
def reward_fn(rollout, tasks):
    r = [(zlib.crc32(t.encode()) % 3) / 2 for t in rollout.texts]
    return r, [float(x == 1.0) for x in r], [float(x > 0) for x in r]
module.train(tyro.cli(module.Args, args=sys.argv[2:]), reward_fn=reward_fn)
"""


def final_weights_and_metrics(runs: Path):
    from safetensors.torch import load_file

    (run,) = [p for p in runs.iterdir() if p.is_dir()]
    checkpoint = max(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return load_file(str(checkpoint / "model.safetensors")), metrics


def compared_versions(before: str) -> dict:
    """The two code versions a comparison ran: --before resolved to its commit, and this tree's."""
    sys.path.insert(0, str(ROOT))
    import bookkeeping

    resolved = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{before}^{{commit}}"],
                              capture_output=True, text=True)
    if resolved.returncode != 0:  # exit 2: 1 says the weights differ
        print(f"--before {before!r} is not a commit of {ROOT}: give a commit, tag or branch of it", file=sys.stderr)
        raise SystemExit(2)
    return {"before": before, "before_commit": resolved.stdout.strip(), "after": bookkeeping.code_version()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit to compare this tree with")
    parser.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    a = parser.parse_args()
    versions = compared_versions(a.before)
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_tiny_model_dir

    same_everywhere = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_tiny_model_dir(tmp / "tiny")
        before = tmp / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(before),
                        versions["before_commit"]], check=True)
        try:
            for script in a.scripts:
                results = {}
                for name, tree in (("before", before), ("after", ROOT)):
                    runs = tmp / f"runs-{name}-{script}"
                    cmd = [sys.executable, "-c", DRIVER, script, "--model", model, *COMMON, *SCRIPTS[script],
                           "--runs-dir", str(runs)]
                    subprocess.run(cmd, cwd=tree, check=True, capture_output=True, text=True)
                    results[name] = final_weights_and_metrics(runs)
                (w0, m0), (w1, m1) = results["before"], results["after"]
                same = w0.keys() == w1.keys() and all(bool((w0[k] == w1[k]).all()) for k in w0)
                logged = [(r0.get("step"), k) for r0, r1 in zip(m0, m1) for k in set(r0) | set(r1)
                          if not k.startswith("time/") and k != "charts/tokens_per_second"
                          and not (isinstance(r0.get(k), float) and isinstance(r1.get(k), float)
                                   and abs(r0[k] - r1[k]) <= 1e-6 * max(1.0, abs(r0[k])))
                          and r0.get(k) != r1.get(k)]
                print(json.dumps({"script": script, **versions, "weights_identical": same,
                                  "metric_rows": [len(m0), len(m1)], "metrics_differing": logged[:10]}), flush=True)
                same_everywhere &= same
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    raise SystemExit(main())
