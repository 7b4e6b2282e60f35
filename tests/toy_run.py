"""Run a script's real training loop with the toy even-token reward, from the command line (so that a
test can kill it): python tests/toy_run.py ALGO [the script's flags]."""

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tyro  # noqa: E402

import bookkeeping  # noqa: E402

import common  # noqa: E402
from conftest import even_token_reward  # noqa: E402

if __name__ == "__main__":
    algo = importlib.import_module(sys.argv[1])
    args = tyro.cli(algo.Args, args=sys.argv[2:])
    common.run_command(lambda: algo.train(args, reward_fn=even_token_reward,
                                          typed_flags=bookkeeping.typed_flags(sys.argv[2:])))
