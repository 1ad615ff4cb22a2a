"""Soak: data-parallel training on the workers for as long as asked; every worker's resident
memory must stay flat.

    mpiexec -n 3 python tools/soak.py --minutes 30

Each step uploads a fresh batch (labels from a fixed random teacher) split over two workers (the home worker sends the other its
half), runs an MLP with replicated weights forward and backward (gradients all-reduced) and
an AdamW step. Every 50th batch has a label out of range: its error is caught, the step is
skipped by the fault rule, and training goes on. Every worker's RSS is sampled every
``--every`` seconds; after the first sample (warm-up) it must stay within ``--limit-mb`` of it.
Prints a table of the samples and ends with one JSON line; exits non-zero if a worker grew.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

import gtmpi
import gtmpi.nn.functional as F

CONFIG = {"soak_data": {"shard": {"axis": 0, "workers": [0, 1]}},
          "soak_weights": {"shard": {"workers": [0, 1], "replicated": True}}}
BAD_EVERY = 50


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--every", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--limit-mb", type=float, default=50.0)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    workers = sorted(gtmpi.info()["workers"])
    if len(workers) < 2:
        sys.exit("soak: needs 2 workers or more (mpiexec -n 3)")
    gtmpi.load_config(CONFIG)
    gen = torch.Generator().manual_seed(0)
    w = args.width
    with gtmpi.signal.context("soak_weights"):
        params = [gtmpi.tensor(t, requires_grad=True) for t in (
            torch.randn(w, w, generator=gen) / w ** 0.5, torch.zeros(w),
            torch.randn(10, w, generator=gen) / w ** 0.5, torch.zeros(10))]
    opt = gtmpi.optim.AdamW(params, lr=1e-3)
    teacher = torch.randn(w, 10, generator=gen)  # labels the model can learn
    start = time.monotonic()
    samples: list[dict] = []
    step = caught = 0
    loss = float("nan")
    print(f"{'min':>6} {'steps':>7} {'loss':>8} {'caught':>6} "
          + " ".join(f"{f'rss{r} MB':>10}" for r in workers)
          + " " + " ".join(f"{f'held{r} MB':>10}" for r in workers), flush=True)
    next_sample = start
    while True:
        now = time.monotonic()
        if now >= next_sample:
            stats = gtmpi.debug.worker_stats()
            samples.append({"s": round(now - start, 1), "steps": step,
                            "rss": {r: stats[r]["rss_bytes"] for r in workers},
                            "held": {r: stats[r]["memory_bytes"] for r in workers}})
            s = samples[-1]
            print(f"{s['s'] / 60:>6.1f} {step:>7} {loss:>8.4f} {caught:>6} "
                  + " ".join(f"{s['rss'][r] / 1e6:>10.1f}" for r in workers) + " "
                  + " ".join(f"{s['held'][r] / 1e6:>10.2f}" for r in workers), flush=True)
            next_sample += args.every
            if now - start >= args.minutes * 60:
                break
        x = torch.randn(args.batch, w, generator=gen)
        y = (x @ teacher).argmax(1)
        step += 1
        if step % BAD_EVERY == 0:
            y[0] = 10  # out of range: the worker's cross_entropy fails
        opt.zero_grad()
        xs, ys = gtmpi.signal.tensor(x, "soak_data"), gtmpi.signal.tensor(y, "soak_data")
        h = F.linear(xs, params[0], params[1]).relu()
        out = F.cross_entropy(F.linear(h, params[2], params[3]), ys)
        out.backward()
        opt.step()
        try:
            loss = out.item()
        except gtmpi.WorkerError:
            caught += 1
    growth = {r: (samples[-1]["rss"][r] - samples[1]["rss"][r]) / 1e6 for r in workers} \
        if len(samples) > 2 else {}
    flat = bool(growth) and all(abs(g) <= args.limit_mb for g in growth.values())
    print(f"RSS growth after warm-up (MB): {growth}  limit {args.limit_mb}: "
          f"{'flat' if flat else 'NOT FLAT'}; bad batches caught {caught} of {step // BAD_EVERY}")
    print(json.dumps({"minutes": args.minutes, "steps": step, "caught": caught,
                      "rss_growth_mb": growth, "limit_mb": args.limit_mb, "flat": flat,
                      "final_loss": loss, "samples": samples}))
    return 0 if flat and caught == step // BAD_EVERY and np.isfinite(loss) else 1


if __name__ == "__main__":
    sys.exit(main())
