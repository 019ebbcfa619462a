"""The loss-fused head back to back, each call's time beside the SM clock and board power that ``nvidia-smi``
samples every 100 ms: whether a sustained run is slower than one call because of the clock.

    PYTHONPATH=src python3 bench/head_clocks.py [--calls 25] [--n 32768] [--h 4096] [--v 151936]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_logprob import head_inputs, make_path  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=25)
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=151936)
    args = ap.parse_args(argv)
    run = make_path("triton_loss", *head_inputs(args.n, args.h, args.v))  # what profile_logprob.py times
    run()  # compiles
    torch.cuda.synchronize()
    time.sleep(3)  # let the clock come back up
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader", "-lms", "100"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    times, t0 = [], time.time()
    try:
        for _ in range(args.calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append((time.time() - t0, start.elapsed_time(end)))
        time.sleep(0.3)
    finally:
        smi.terminate()
    samples = smi.communicate()[0].strip().splitlines()
    print("per call (s since start: ms):", " ".join(f"{t:.1f}:{ms:.1f}" for t, ms in times))
    print(f"nvidia-smi samples (timestamp, SM clock, power, temperature): {len(samples)}")
    for line in samples[:: max(1, len(samples) // 30)]:
        print(line)


if __name__ == "__main__":
    main()
