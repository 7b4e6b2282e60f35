"""How soon each finished run showed a gain, read from its own records (nothing is run): the logged minutes of
training and evaluation (time/step + time/eval summed over its rows, as study/run.py's summary counts a run's wall
time; loading, checkpoints and the warm start are not in it) until its first held-out evaluation at
least --margin above the best constant answer on the same tasks. The README's first command adds, before its
step 0, the bundled model's conversion and the warm start (benchmark/first_command.py measures the whole).

A link to a run of another experiment (study/run.py links a variant that is another's run) is read once.

    python benchmark/time_to_gain.py study/results/cpu/*/*__*
    python benchmark/time_to_gain.py study/results/cpu/*/*__* --margin 0.1
"""

import argparse
import importlib.util
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from plot import read_rows  # noqa: E402

_spec = importlib.util.spec_from_file_location("study_run", ROOT / "study" / "run.py")
study = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look it up there
_spec.loader.exec_module(study)  # its percent() (the study's tables round half up) and wall_minutes()


def first_gain(rows: list[dict], margin: float) -> dict:
    """The first evaluation after step 0 with accuracy >= best constant + margin, and the logged minutes up to and
    including it; or, when none has, the last evaluation's step and the minutes of the whole run."""
    minutes, last = 0.0, None
    for row in rows:
        minutes += study.wall_minutes([row])
        if not all(math.isfinite(row.get(k, math.nan)) for k in ("charts/eval_accuracy", "charts/eval_best_constant")):
            continue  # not an evaluation, one from before evaluations logged their baseline, or a hand-edited value
        last = row
        if row["step"] > 0 and row["charts/eval_accuracy"] >= row["charts/eval_best_constant"] + margin:
            return dict(step=row["step"], accuracy=row["charts/eval_accuracy"],
                        best_constant=row["charts/eval_best_constant"], minutes=minutes, gained=True)
    if last is None:
        return dict(step=None, accuracy=None, best_constant=None, minutes=minutes, gained=False)
    return dict(step=last["step"], accuracy=last["charts/eval_accuracy"],
                best_constant=last["charts/eval_best_constant"], minutes=minutes, gained=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (metrics.jsonl inside)")
    parser.add_argument("--margin", type=float, default=0.05,
                        help="how far above the best constant answer counts as a gain (a share: 0.05 is 5 points)")
    args = parser.parse_args()
    seen, results = set(), []
    for run in args.runs:
        if run.resolve() not in seen:  # read_rows names a run whose metrics.jsonl cannot be read, in one line
            seen.add(run.resolve())
            results.append((run, first_gain(read_rows(run), args.margin)))
    results.sort(key=lambda item: (not item[1]["gained"], item[1]["minutes"]))
    print(f"| run | first evaluation >= best constant + {100 * args.margin:g} points | accuracy | best constant "
          "| logged minutes until then |")
    print("|---|---|---|---|---|")
    for run, r in results:
        name = f"{run.resolve().parent.name}/{run.resolve().name}"
        if r["step"] is None:
            print(f"| {name} | no evaluation with its best constant | | | {r['minutes']:.1f} |")
        elif r["gained"]:
            print(f"| {name} | step {r['step']} | {study.percent(r['accuracy'])} | {study.percent(r['best_constant'])} "
                  f"| {r['minutes']:.1f} |")
        else:
            print(f"| {name} | none by step {r['step']} | {study.percent(r['accuracy'])} (last) "
                  f"| {study.percent(r['best_constant'])} | {r['minutes']:.1f} (whole run) |")


if __name__ == "__main__":
    common.run_command(main)
