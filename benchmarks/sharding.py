"""Sharding on 2 GPUs: collectives through gtmpi against plain torch.distributed, and
data- and tensor-parallel speed-ups over one worker.

    mpiexec -n 3 python benchmarks/sharding.py        # 2 workers, one GPU each

(a) all-reduce of 256 MB: gtmpi sums a partial tensor (P -> R, in place, as its gradients are)
    against dist.all_reduce in two plain torch processes (NCCL) started by this run. Both loops
    also make the partial tensor (a sum over a sharded dim), the same work on both sides; the
    NCCL kernel's own bandwidth comes from CUDA events on both sides.
(b) data parallel MLP training step (AdamW), 2 workers against 1: throughput ratio.
(c) tensor parallel chain of matmuls (column- then row-parallel), 2 workers against 1.
Plain torch on one GPU (rank 0's process, on the first worker's GPU) runs (b) and (c) too.
Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import time

import torch


def torch_allreduce(rank: int, port: int, numel: int, iters: int) -> None:
    """One process of the plain torch.distributed baseline (no gtmpi, no MPI)."""
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    x = torch.randn(1, numel, device="cuda")
    out = {}
    for name, step in [("allreduce", lambda: dist.all_reduce(q)),
                       ("sum_allreduce", lambda: dist.all_reduce(x.sum(0)))]:
        q = torch.empty(numel, device="cuda")
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start, kernel = time.perf_counter(), []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            kernel.append((a, b))
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - start) / iters
        out[name + "_gpu"] = min(a.elapsed_time(b) for a, b in kernel) / 1e3
    if rank == 0:
        print("BASELINE", json.dumps(out), flush=True)
    dist.destroy_process_group()


def baseline(numel: int, iters: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX_", "SLURM_", "HYDRA_", "MPI"))}
    procs = [subprocess.Popen([sys.executable, __file__, "--torch-worker", str(r), str(port),
                               str(numel), str(iters)], env=env, stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return json.loads(outs[0].split("BASELINE ", 1)[1])


def timed(step, sync, n: int) -> float:
    step()
    sync()
    start = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    return (time.perf_counter() - start) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=256, help="all-reduce size (MB of float32)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--width", type=int, default=4096, help="MLP width and batch in (b)")
    p.add_argument("--chain", type=int, default=8192, help="matrix size in (c)")
    args = p.parse_args()
    numel = args.mb * (1 << 20) // 4
    import gtmpi  # ranks > 0 become gtmpi's workers here
    import gtmpi.nn.functional as F
    from gtmpi.recording import fileformat
    from gtmpi.trace import analysis
    from gtmpi.recording.events import Flag, Kind
    workers = sorted(gtmpi.info()["workers"])
    devices = [gtmpi.info()["workers"][r]["device"] for r in workers]
    if len(workers) != 2 or len(set(devices)) != 2 or not devices[0].startswith("cuda"):
        raise SystemExit(f"needs 2 workers with a GPU each, got {devices}")
    base = baseline(numel, args.iters)
    gtmpi.load_config({"data": {"shard": {"axis": 0, "workers": [0, 1]}},
                       "weights": {"shard": {"workers": [0, 1], "replicated": True}},
                       "col": {"shard": {"axis": 1, "workers": [0, 1]}},
                       "row": {"shard": {"axis": 0, "workers": [0, 1]}}})
    res: dict = {}

    # (a) -------------------------------------------------------------------------------
    with gtmpi.signal.context("data"):
        x = gtmpi.randn(2, numel)

    def partial_then_sum():
        q = x.sum(0)        # a partial sum on each worker (P)
        return q[0:1]       # whole values needed: the all-reduce, in place

    res["sum_allreduce"] = timed(partial_then_sum, gtmpi.synchronize, args.iters)
    path = f"/tmp/gtmpi-sharding-{os.getpid()}.h5"
    gtmpi.trace.start(path, gpu_every=1)
    for _ in range(args.iters):
        partial_then_sum()
    gtmpi.synchronize()
    gtmpi.trace.stop()
    trace = fileformat.read(path)
    os.remove(path)
    kernel = []
    for table in trace.events.values():
        reduce = analysis.select(table, (Kind.COLLECTIVE,))
        reduce = reduce[(reduce["flags"] & Flag.GPU_TIMED) != 0]
        kernel += list((reduce["gpu_t1"] - reduce["gpu_t0"]) / 1e9)
    res["allreduce_gpu"] = min(kernel)
    del x

    # (b) -------------------------------------------------------------------------------
    w = args.width
    gen = torch.Generator().manual_seed(0)
    xh, yh = torch.randn(w, w, generator=gen), torch.randint(0, 16, (w,), generator=gen)
    shapes = [(w, w), (w,), (w, w), (w,), (w, w), (w,), (16, w), (16,)]
    init = [torch.randn(s, generator=gen) * 0.02 for s in shapes]

    def mlp(lib, F_, params, x, y):
        h = x
        for i in range(0, 6, 2):
            h = F_.linear(h, params[i], params[i + 1]).relu()
        return F_.cross_entropy(F_.linear(h, params[6], params[7]), y)

    def dp_step(sharded: bool):
        ctx = gtmpi.signal.context if sharded else (lambda name: contextlib.nullcontext())
        with ctx("weights"):
            params = [gtmpi.tensor(t, requires_grad=True) for t in init]
        with ctx("data"):
            x, y = gtmpi.tensor(xh), gtmpi.tensor(yh)
        opt = gtmpi.optim.AdamW(params, lr=1e-4)

        def step():
            opt.zero_grad()
            mlp(gtmpi, F, params, x, y).backward()
            opt.step()
        return timed(step, gtmpi.synchronize, 10)

    res["dp1"], res["dp2"] = dp_step(False), dp_step(True)

    # (c) -------------------------------------------------------------------------------
    n = args.chain
    hc = torch.randn(n, n, generator=gen) / n ** 0.5
    mats = [torch.randn(n, n, generator=gen) / n ** 0.5 for _ in range(4)]

    def tp_chain(sharded: bool):
        ctx = gtmpi.signal.context if sharded else (lambda name: contextlib.nullcontext())
        with ctx("weights"):
            h0 = gtmpi.tensor(hc)
        ws = []
        for i, m in enumerate(mats):
            with ctx("col" if i % 2 == 0 else "row"):
                ws.append(gtmpi.tensor(m))

        def chain():
            h = h0
            for i in range(0, 4, 2):
                h = (h @ ws[i]) @ ws[i + 1]   # column- then row-parallel: one all-reduce
            return h[0:1]
        return timed(chain, gtmpi.synchronize, 5)

    res["tp1"], res["tp2"] = tp_chain(False), tp_chain(True)

    # plain torch on one GPU ---------------------------------------------------------------
    dev = torch.device(devices[0])
    torch.cuda.set_device(dev)
    tparams = [t.to(dev).requires_grad_() for t in init]
    topt = torch.optim.AdamW(tparams, lr=1e-4)
    tx, ty = xh.to(dev), yh.to(dev)

    def torch_step():
        topt.zero_grad()
        mlp(torch, torch.nn.functional, tparams, tx, ty).backward()
        topt.step()
    res["dp_torch"] = timed(torch_step, torch.cuda.synchronize, 10)
    th, tm = hc.to(dev), [m.to(dev) for m in mats]

    def torch_chain():
        h = th
        for i in range(0, 4, 2):
            h = (h @ tm[i]) @ tm[i + 1]
    res["tp_torch"] = timed(torch_chain, torch.cuda.synchronize, 5)

    gb = numel * 4 / 1e9
    rows = [
        (f"(a) {args.mb} MB partial sum + all-reduce, ms", base["sum_allreduce"] * 1e3, None, res["sum_allreduce"] * 1e3),
        ("(a) all-reduce kernel (CUDA events), GB/s", gb / base["allreduce_gpu"], None, gb / res["allreduce_gpu"]),
        ("(a) all-reduce alone in torch, ms", base["allreduce"] * 1e3, None, None),
        (f"(b) DP MLP step {w}x{w}, 4 layers, ms", res["dp_torch"] * 1e3, res["dp1"] * 1e3, res["dp2"] * 1e3),
        (f"(c) TP chain 4 matmuls {n}², ms", res["tp_torch"] * 1e3, res["tp1"] * 1e3, res["tp2"] * 1e3),
    ]
    print(f"{platform.node()}: {devices}, torch {torch.__version__}")
    print(f"{'measure':<44} {'torch':>10} {'gtmpi 1w':>10} {'gtmpi 2w':>10}")
    for label, t, one, two in rows:
        cells = [f"{v:10.2f}" if v is not None else f"{'-':>10}" for v in (t, one, two)]
        print(f"{label:<44} {' '.join(cells)}")
    figures = {
        "allreduce_time_ratio": base["sum_allreduce"] / res["sum_allreduce"],
        "allreduce_kernel_bw_ratio": base["allreduce_gpu"] / res["allreduce_gpu"],
        "dp_speedup": res["dp1"] / res["dp2"], "tp_speedup": res["tp1"] / res["tp2"]}
    print(f"(a) torch/gtmpi time {figures['allreduce_time_ratio']:.3f}, kernel bandwidth "
          f"{figures['allreduce_kernel_bw_ratio']:.3f} (target ≥ 0.90); (b) DP speed-up "
          f"{figures['dp_speedup']:.3f} (≥ 1.8); (c) TP speed-up {figures['tp_speedup']:.3f} (≥ 1.7)")
    print(json.dumps({"benchmark": "sharding", "devices": devices, "host": platform.node(),
                      **{f"torch_{k}": round(v, 6) for k, v in base.items()},
                      **{f"gtmpi_{k}": round(v, 6) for k, v in res.items()},
                      **{k: round(v, 4) for k, v in figures.items()}}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--torch-worker"]:
        torch_allreduce(*map(int, sys.argv[2:6]))
    else:
        main()
