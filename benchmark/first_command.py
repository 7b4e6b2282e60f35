"""How long a newcomer's first command takes to show held-out accuracy above the best constant answer.

Runs the README's first command (`python grpo.py`, no flags) as a fresh clone would: with an empty
RL_COUNTDOWN_CACHE, so the bundled model is converted and the warm start is made inside the measured time.
It watches the run's metrics.jsonl and prints one JSON line per held-out evaluation: minutes since the
command started, step, greedy accuracy, the best constant answer's accuracy on the same tasks, and the
gain over it. It stops the run (as Ctrl-C would) once `--minutes` have passed, or when the run ends, and removes the run
folder (and the cache it made), unless the run failed: then its folder and output stay for a look.

    python benchmark/first_command.py                          # python grpo.py, 20 minutes
    python benchmark/first_command.py --cache ~/.cache/rl-countdown --minutes 15   # warm start already made
    python benchmark/first_command.py --extra="--seed 2"
"""

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bookkeeping  # noqa: E402


def new_rows(path: str, seen: int) -> list[dict]:
    """The complete lines of metrics.jsonl after the first `seen`."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")[:-1]  # the last piece is empty or a line still being written
    return [json.loads(line) for line in lines[seen:]]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", default="grpo.py")
    p.add_argument("--extra", default="", help="flags added to the command (default: none, as the README runs it)")
    p.add_argument("--cache", default="", help="RL_COUNTDOWN_CACHE for the run (default: a new empty folder)")
    p.add_argument("--minutes", type=float, default=20.0,
                   help="stop the run after this long (the goal: a gain within 20 minutes of the command)")
    a = p.parse_args()

    cache = a.cache or tempfile.mkdtemp(prefix="first-command-cache-")
    os.makedirs(cache, exist_ok=True)
    runs = tempfile.mkdtemp(prefix="first-command-runs-")
    cmd = [sys.executable, os.path.join(ROOT, a.script), "--runs-dir", runs, *shlex.split(a.extra)]
    print(json.dumps({"command": shlex.join(["python", *cmd[1:]]), "cache": cache,
                      "cache_was_empty": not os.listdir(cache), **bookkeeping.code_version()}), flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill stops the run too (the finally below)
    log = open(os.path.join(runs, "output.log"), "w")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "RL_COUNTDOWN_CACHE": cache}, stdout=log,
                            stderr=subprocess.STDOUT)
    seen = 0

    def report(late: bool = False):
        nonlocal seen
        folders = [f for f in os.listdir(runs) if os.path.isdir(os.path.join(runs, f))]
        for row in new_rows(os.path.join(runs, folders[0], "metrics.jsonl"), seen) if folders else []:
            seen += 1
            if "charts/eval_accuracy" in row:
                accuracy, constant = row["charts/eval_accuracy"], row["charts/eval_best_constant"]
                print(json.dumps({"minutes": round((time.monotonic() - start) / 60, 1), "step": row["step"],
                                  "eval_accuracy": accuracy, "best_constant": constant,
                                  "gain": round(accuracy - constant, 4),
                                  "uniform_guess": row["charts/eval_uniform_guess"],
                                  **({"after_the_limit": True} if late else {})}), flush=True)

    try:
        while proc.poll() is None and time.monotonic() - start < a.minutes * 60:
            time.sleep(2)
            report()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the scripts stop at the end of the step and save
            try:
                proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        report(late=True)  # an evaluation that ended while the run was stopping
        log.close()
        if proc.returncode == 0 or proc.returncode == -signal.SIGINT:
            shutil.rmtree(runs, ignore_errors=True)  # a checkpoint of the bundled model is 1.6 GB
        else:
            print(f"the run failed: its output and folder are kept in {runs}", file=sys.stderr)
        if not a.cache:
            shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps({"minutes_total": round((time.monotonic() - start) / 60, 1), "exit_code": proc.returncode}))


if __name__ == "__main__":
    main()
