"""What tracing costs: the tiny-op and matmul loops of dispatch.py with the trace off and on.

    mpiexec -n 3 python benchmarks/trace_overhead.py     # 2 workers
    python benchmarks/trace_overhead.py                 # embedded worker

Off and on alternate, best of --repeat each; the trace is started before and stopped (its
file written) after each timed loop, so the figures are the cost of recording only. Targets:
on/off ≥ 0.75 for the tiny-op throughput (≤ 25% slower) and ≤ 1.05 for the matmul time.
Plain torch runs the same loops in rank 0's process on the first worker's device. Prints a
table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile

import torch

import gtmpi
from dispatch import matmul_loop, tiny_ops


def first_item(t):
    return t.reshape(-1)[0].item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=10_000, help="adds in the tiny-op loop")
    p.add_argument("--matmuls", type=int, default=None, help="matmuls per loop (default: 3 on CPU, 50 on GPU)")
    p.add_argument("--size", type=int, default=4096, help="matmul size")
    p.add_argument("--repeat", type=int, default=5, help="off/on pairs; the best of each is kept")
    args = p.parse_args()

    world = gtmpi.info()
    device = torch.device(world["workers"][min(world["workers"])]["device"])
    n_mm = args.matmuls or (50 if device.type == "cuda" else 3)
    folder = tempfile.mkdtemp(prefix="gtmpi-trace-bench-")

    torch.manual_seed(0)
    a_t = torch.randn(args.size, args.size, device=device)
    b_t = torch.randn(args.size, args.size, device=device)
    a_g, b_g = gtmpi.tensor(a_t.cpu(), device="cuda"), gtmpi.tensor(b_t.cpu(), device="cuda")
    loops = {
        "ops_per_s": (lambda: tiny_ops(args.ops, lambda: gtmpi.zeros(64, 64, device="cuda"), first_item), max),
        "matmul_s": (lambda: matmul_loop(n_mm, a_g, b_g, first_item), min),
    }
    res: dict[str, dict[str, float]] = {"torch": {}, "off": {}, "on": {}}
    res["torch"]["ops_per_s"] = max(tiny_ops(args.ops, lambda: torch.zeros(64, 64, device=device),
                                             first_item) for _ in range(args.repeat))
    matmul_loop(1, a_t, b_t, first_item)
    res["torch"]["matmul_s"] = min(matmul_loop(n_mm, a_t, b_t, first_item) for _ in range(args.repeat))
    events = 0
    for key, (loop, best) in loops.items():
        loop()  # warm-up: first-use imports, shape-cache entries
        for mode in ("off", "on"):
            res[mode][key] = []
        for r in range(args.repeat):
            res["off"][key].append(loop())
            path = os.path.join(folder, f"{key}{r}.h5")
            gtmpi.synchronize()
            gtmpi.trace.start(path)
            res["on"][key].append(loop())
            gtmpi.trace.stop()
            if r == 0:
                from gtmpi.recording import fileformat
                events += sum(len(t) for t in fileformat.read(path).events.values())
            os.remove(path)
        for mode in ("off", "on"):
            res[mode][key] = best(res[mode][key])
    os.rmdir(folder)

    ops_ratio = res["on"]["ops_per_s"] / res["off"]["ops_per_s"]
    mm_ratio = res["on"]["matmul_s"] / res["off"]["matmul_s"]
    print(f"device {device} ({platform.node()}), {len(world['workers'])} worker(s)"
          f"{' (embedded)' if world['embedded'] else ''}, torch {torch.__version__}, "
          f"best of {args.repeat}; {events} events in one traced loop of each kind")
    print(f"{'measure':<36} {'torch':>12} {'trace off':>12} {'trace on':>12} {'on/off':>8}")
    print(f"{f'{args.ops} adds 64x64 + read, ops/s':<36} {res['torch']['ops_per_s']:12.0f} "
          f"{res['off']['ops_per_s']:12.0f} {res['on']['ops_per_s']:12.0f} {ops_ratio:8.3f}")
    print(f"{f'{n_mm} matmuls {args.size}² fp32, s':<36} {res['torch']['matmul_s']:12.4f} "
          f"{res['off']['matmul_s']:12.4f} {res['on']['matmul_s']:12.4f} {mm_ratio:8.3f}")
    print(json.dumps({"benchmark": "trace_overhead", "device": str(device),
                      "workers": len(world["workers"]), "embedded": world["embedded"],
                      "host": platform.node(),
                      "torch_ops_per_s": round(res["torch"]["ops_per_s"]),
                      "off_ops_per_s": round(res["off"]["ops_per_s"]),
                      "on_ops_per_s": round(res["on"]["ops_per_s"]),
                      "tiny_slowdown_pct": round(100 * (1 / ops_ratio - 1), 2),
                      "torch_matmul_s": round(res["torch"]["matmul_s"], 5),
                      "off_matmul_s": round(res["off"]["matmul_s"], 5),
                      "on_matmul_s": round(res["on"]["matmul_s"], 5),
                      "matmul_slowdown_pct": round(100 * (mm_ratio - 1), 2)}))


if __name__ == "__main__":
    main()
