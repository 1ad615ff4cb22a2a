"""A model built on the host and moved to the GPU: gtmpi beside torch in the same run.

    mpiexec -n 2 python benchmarks/upload.py --layers 4         # 1.22B parameters, float32
    mpiexec -n 2 python benchmarks/upload.py --layers 1 --dim 1024   # a check on CPUs

The GPT of examples/gpt/model.py (--layers blocks of --dim, vocabulary 50304) is built in
float32 with torch's initialisation, as nanoGPT builds it, then moved to the first GPU (the
CPU where there is none): torch by ``model.to(device)``; gtmpi by ``model.to("cuda")``, which
places every parameter the client holds on its worker, then ``synchronize()``, so that its
time includes every byte's arrival on the worker. Rank 0's time for each part, and the move's
rate; then every parameter gtmpi moved is read back and compared with torch's (both built from
the same seed). A table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gtmpi  # noqa: E402
from examples.gpt.model import Config, build  # noqa: E402


def timed(lib, cfg: Config, device: str) -> tuple[dict, object]:
    torch.manual_seed(0)  # gtmpi's held parameters draw from torch's generator: equal weights
    start = time.perf_counter()
    model = build(lib)(cfg)
    built = time.perf_counter()
    model.to("cuda" if lib is gtmpi else device)  # gtmpi's: the workers', GPU or CPU
    (gtmpi.synchronize if lib is gtmpi else
     torch.cuda.synchronize if device == "cuda" else (lambda: None))()
    moved = time.perf_counter()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    took = max(moved - built, 1e-9)
    return {"build_s": round(built - start, 2), "move_s": round(moved - built, 2),
            "gb": round(nbytes / 1e9, 2), "gb_per_s": round(nbytes / 1e9 / took, 2)}, model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=4096)
    args = p.parse_args()
    cfg = Config(vocab=50304, seq=1024, layers=args.layers, heads=max(args.dim // 128, 1),
                 dim=args.dim)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    theirs, peer = timed(torch, cfg, device)
    ours, model = timed(gtmpi, cfg, device)
    rows = {"torch": theirs, "gtmpi": ours}
    # what arrived on the worker is what torch moved: every parameter, read back whole
    equal = all(torch.equal(p.cpu_torch(), q.cpu()) for p, q in
                zip(model.parameters(), peer.parameters()))
    print(f"GPT of {args.layers} blocks of {args.dim}, float32, built on the host, moved to "
          f"{device}")
    print(f"{'':<6} {'build s':>8} {'move s':>7} {'GB':>6} {'GB/s':>6}")
    for name, r in rows.items():
        print(f"{name:<6} {r['build_s']:>8.2f} {r['move_s']:>7.2f} {r['gb']:>6.2f} "
              f"{r['gb_per_s']:>6.2f}")
    print(f"gtmpi's parameters on its worker equal torch's: {equal}")
    print(json.dumps({"benchmark": "upload", "layers": args.layers, "dim": args.dim,
                      "device": device, "equal": equal, **{f"{n}_{k}": v for n, r in rows.items()
                                           for k, v in r.items()}}))


if __name__ == "__main__":
    main()
