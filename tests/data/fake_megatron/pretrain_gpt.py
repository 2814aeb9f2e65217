"""A stand-in for Megatron-LM's pretrain_gpt.py (tests only: no GPU, no torch).

It reads the flags `autotune.export.megatron_args` writes and prints what Megatron-LM prints for a
short run, with Megatron-LM's own format strings (megatron/training/training.py `training_log`,
megatron/training/utils/common_utils.py `report_memory`, at NVIDIA/Megatron-LM d98e8a6):

    log_string = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    log_string += ' iteration {:8d}/{:8d} |'.format(iteration, args.train_iters)
    log_string += ' consumed samples: {:12d} |'.format(args.consumed_train_samples)
    log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(elapsed_time_per_iteration * 1000.0)
    log_string += f' throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |'
    log_string += f' learning rate: {learning_rate:.6E} |'
    log_string += f' global batch size: {batch_size:5d} |'
    log_string += ' {}: {:.6E} |'.format(key, avg)              # lm loss
    log_string += f' loss scale: {loss_scale:.1f} |'
    log_string += f' grad norm: {grad_norm:.3f} |'
    log_string += ' number of skipped iterations: {:3d} |'
    log_string += ' number of nan iterations: {:3d} |'
    "[Rank {}] {}".format(rank, name + ' memory (MB) | allocated: ... | max allocated: ... | reserved: ... | max reserved: ...')

The "measured" numbers are a deterministic function of the plan (FAKE_MEGATRON_MS_PER_STEP times a
factor per knob), so a test knows what the log says. FAKE_MEGATRON_OOM_MBS=k: micro-batches of k or
more stop with PyTorch's out-of-memory error (torch.OutOfMemoryError's message) and exit code 1.
FAKE_MEGATRON_ARGV=FILE: the arguments are appended to FILE (one JSON list per run).
FAKE_MEGATRON_SLEEP_S=x: each iteration also takes x seconds of wall time (a run to interrupt).
"""
import json
import os
import sys
import time
from datetime import datetime


def flag(name, default=None):
    argv = sys.argv[1:]
    return argv[argv.index(name) + 1] if name in argv else default


def main():
    if os.environ.get("FAKE_MEGATRON_ARGV"):
        with open(os.environ["FAKE_MEGATRON_ARGV"], "a") as fh:
            fh.write(json.dumps(sys.argv[1:]) + "\n")
    iters = int(flag("--train-iters"))
    gb = int(flag("--global-batch-size"))
    mbs = int(flag("--micro-batch-size", "1"))
    tp = int(flag("--tensor-model-parallel-size", "1"))
    pp = int(flag("--pipeline-model-parallel-size", "1"))
    oom = os.environ.get("FAKE_MEGATRON_OOM_MBS")
    if oom and mbs >= int(oom):
        print("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
              "capacity of 79.19 GiB of which 1.05 GiB is free.", flush=True)
        sys.exit(1)
    base_ms = float(os.environ.get("FAKE_MEGATRON_MS_PER_STEP", "1000"))
    ms = base_ms * (1 + 0.25 * (tp - 1) + 0.5 * (pp - 1)) / (1 + 0.1 * (mbs - 1))
    for it in range(1, iters + 1):
        elapsed = ms * (3.0 if it == 1 else 1.0 + 0.001 * (it % 3))    # the first iteration compiles
        s = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
        s += ' iteration {:8d}/{:8d} |'.format(it, iters)
        s += ' consumed samples: {:12d} |'.format(it * gb)
        s += ' elapsed time per iteration (ms): {:.1f} |'.format(elapsed)
        s += f' throughput per GPU (TFLOP/s/GPU): {400.0 * 1000.0 / elapsed:.1f} |'
        s += f' learning rate: {1.0e-4:.6E} |'
        s += f' global batch size: {gb:5d} |'
        s += ' {}: {:.6E} |'.format('lm loss', 10.5 - 0.1 * it)
        s += f' loss scale: {1.0:.1f} |'
        s += f' grad norm: {2.5:.3f} |'
        s += ' number of skipped iterations: {:3d} |'.format(0)
        s += ' number of nan iterations: {:3d} |'.format(0)
        print(s, flush=True)
        time.sleep(float(os.environ.get("FAKE_MEGATRON_SLEEP_S", "0")))
        mb = 1024.0 * 1024.0
        alloc = 20e9 * (1 + 0.1 * mbs) / tp / pp
        string = f'(after {it} iterations)' + ' memory (MB)'
        string += f" | allocated: {alloc * 0.6 / mb:.2f}"
        string += f" | max allocated: {alloc / mb:.2f}"
        string += f" | reserved: {alloc * 1.1 / mb:.2f}"
        string += f" | max reserved: {alloc * 1.1 / mb:.2f}"
        print("[Rank {}] {}".format(0, string), flush=True)


if __name__ == "__main__":
    main()
