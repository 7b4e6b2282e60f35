"""A torchrun worker whose gloo worker thread still runs Python when its command has returned: a stand-in, made
certain, for a worker thread that frees a run's last collective late (the scripts' own end, a barrier and
destroy_process_group, would wait for this callback). common.run_command must end the process cleanly.

usage: torchrun --nproc_per_node=2 tests/teardown_worker.py run_command|return
(`return`: the command returns as a plain script would, for the test to show that the worker then aborts)
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

import common  # noqa: E402


class SlowToFree:
    """Interpreter shutdown frees the module's globals: this one keeps it shutting down for 5 s."""

    def __del__(self, sleep=time.sleep):  # the module's `time` is gone by then
        sleep(5)


def main():
    world = common.setup_distributed("cpu")
    if world.rank == 1:
        time.sleep(0.5)  # so rank 0's barrier cannot finish before its callback is attached (it would run inline)
    done = dist.barrier(async_op=True).get_future()
    done.then(lambda _: time.sleep(2))  # a gloo worker thread runs this, and wants the GIL back after 2 s
    done.wait()  # returns once the barrier is done, before the callback has run
    print(f"rank {world.rank}: command returned", flush=True)  # what follows is the interpreter's shutdown


slow = SlowToFree()
if sys.argv[1] == "run_command":
    common.run_command(main)
else:
    main()
