"""Rank 0's host cost per op of a repeated loop, beside torch's own in the same run.

    mpiexec -n 2 python benchmarks/host_per_op.py                          # one worker
    GTMPI_CONFIG=configs/ddp.yaml mpiexec -n 3 python benchmarks/host_per_op.py   # DP x2
    GTMPI_AUTO_REPLAY_PLACED=1 GTMPI_CONFIG=configs/ddp.yaml mpiexec -n 3 ...     # DP x2, held

A step issues 201 ops: 50 times a Linear layer, relu, a scale and a residual add on a batch of 8
rows, then a sum, read once. Once the workers replay a step as a graph, what bounds it is
rank 0's own time per op (the client's autograd record, placing, holding the run): that is
measured here as rank 0's CPU time (process_time, so workers sharing the cores do not count),
median over 20 steps after 5 warm-up steps. torch runs the same step in rank 0's process on
the CPU, measured the same way. Prints a table, then one JSON line.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np
import torch

import gtmpi

OPS_PER_STEP = 50 * 4 + 1


def per_op_us(lib, x, layer, read, steps: int = 20, warm: int = 5) -> float:
    def step():
        y = x
        for _ in range(50):
            y = layer(y).relu() * 0.5 + y
        return y.sum()

    for _ in range(warm):
        read(step())
    times = []
    for _ in range(steps):
        start = time.process_time()
        s = step()
        times.append(time.process_time() - start)
        read(s)
    return statistics.median(times) / OPS_PER_STEP * 1e6


def main() -> None:
    data = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    torch_us = per_op_us(torch, torch.from_numpy(data), torch.nn.Linear(64, 64),
                         lambda s: s.item())
    gx = gtmpi.from_numpy(data).to("cuda")
    gtmpi_us = per_op_us(gtmpi, gx, gtmpi.nn.Linear(64, 64).to("cuda"), lambda s: s.item())
    workers = len(gtmpi.info()["workers"])
    mode = ("DP by " + os.path.basename(os.environ["GTMPI_CONFIG"])
            if os.environ.get("GTMPI_CONFIG") else "one worker") + \
        (", placed runs held" if os.environ.get("GTMPI_AUTO_REPLAY_PLACED") == "1" else "")
    name = f"gtmpi rank 0, {workers} worker(s), {mode}"
    print(f"{'run':62} {'host us/op':>11}")
    print(f"{'torch (CPU, in rank 0)':62} {torch_us:11.1f}")
    print(f"{name:62} {gtmpi_us:11.1f}")
    print(gtmpi.debug.repeats())
    print(json.dumps({"benchmark": "host_per_op", "workers": workers, "mode": mode,
                      "torch_us": round(torch_us, 2), "gtmpi_us": round(gtmpi_us, 2)}))


if __name__ == "__main__":
    main()
