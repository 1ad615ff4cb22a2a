"""What one tensor-parallel all-reduce of the GPT costs on this host's GPUs, alone and beside
the matmul it would have to hide behind: the floor under TP=2's step (issue 20).

Megatron TP sums a (batch x seq x hidden) activation once after each row-parallel layer in
forward and once before each column-parallel layer's input in backward. The forward's sums
sit on the critical path: the next op reads them. This measures, on 2 GPUs, inside a CUDA
graph as gtmpi's replayed steps run them (and eagerly, for comparison):

    ar        one all-reduce of the activation (NCCL, the process group's defaults)
    mm        the row-parallel matmul that makes it (tokens x hidden/2 @ hidden/2 x hidden)
    mm+ar     the matmul on the main stream beside an all-reduce on a side stream (what an
              overlap in pieces can at best get: their sum is the time with no overlap)
    mm/c, mm+ar/c   the same with cuBLAS held to all SMs but c (--carveouts): a GEMM that
              takes every SM leaves NCCL's blocks none until it ends
    ce, mm+ce the sum by copies between the two GPUs' memory (torch's symmetric memory: each
              GPU pulls the half it sums from its peer, adds, then pulls the other summed
              half) alone and beside the matmul (--copy-engine, 2 GPUs): copies run
              on the GPU's copy engines, not its SMs

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/allreduce.py

Prints a table (rank 0) and one JSON line. The NCCL_* environment applies as usual.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Callable

import torch
import torch.distributed as dist


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median of reps timings of fn on the current stream, in microseconds."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def graphed(body: Callable[[], None], inner: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of inner runs of body."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm NCCL and cuBLAS outside the capture
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            body()
    return graph


def beside(summing: Callable[[], None], mm: Callable[[], None]) -> Callable[[], None]:
    """summing on a side stream, mm on the current one beside it."""
    side = torch.cuda.Stream()

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            summing()
        mm()
        torch.cuda.current_stream().wait_stream(side)
    return both


def measure(name: str, body: Callable[[], None], reps: int, inner: int) -> tuple[float, float]:
    """body's µs per run, eagerly and inside a CUDA graph (nan where it cannot be captured)."""
    eager = timed(lambda: [body() for _ in range(inner)], reps) / inner
    try:
        graph = graphed(body, inner)
    except RuntimeError as e:  # a capture the symmetric memory's barrier refuses
        print(f"{name}: not captured ({str(e).splitlines()[0]})")
        return eager, float("nan")
    in_graph = timed(graph.replay, reps) / inner
    # a graph holding NCCL kernels must go before its process group, or teardown hangs
    del graph
    return eager, in_graph


def copy_engine_rows(act: torch.Tensor, mm: Callable[[], None], reps: int, inner: int) -> dict:
    """The 2-GPU sum of act by copies between the GPUs' symmetric memory, alone and beside mm:
    {name: (eager µs, graph µs)}."""
    import torch.distributed._symmetric_memory as symm_mem
    group = dist.group.WORLD.group_name
    buf = symm_mem.empty(act.shape, dtype=act.dtype, device=act.device)
    buf.copy_(act)
    handle = symm_mem.rendezvous(buf, group)
    rank, peer = handle.rank, 1 - handle.rank
    half = act.shape[0] // 2
    shape, width = (half, act.shape[1]), half * act.shape[1]
    pulled = torch.empty(shape, dtype=act.dtype, device=act.device)

    def ce() -> None:
        handle.barrier()
        pulled.copy_(handle.get_buffer(peer, shape, act.dtype, rank * width))
        buf[rank * half:(rank + 1) * half].add_(pulled)
        handle.barrier()
        buf[peer * half:(peer + 1) * half].copy_(handle.get_buffer(peer, shape, act.dtype,
                                                                   peer * width))

    return {name: measure(name, body, reps, inner)
            for name, body in (("ce", ce), ("mm+ce", beside(ce, mm)))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16 * 1024, help="batch x seq")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--inner", type=int, default=24, help="operations per graph")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--carveouts", default="16,32",
                   help="SMs kept from cuBLAS in the mm/c rows (comma-separated; empty: none)")
    p.add_argument("--copy-engine", action="store_true", help="also the ce and mm+ce rows")
    args = p.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    world = dist.get_world_size()
    h, t = args.hidden, args.tokens
    act = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    x = torch.randn(t, h // world, device=dev, dtype=torch.bfloat16)
    w = torch.randn(h // world, h, device=dev, dtype=torch.bfloat16)
    out = torch.empty(t, h, device=dev, dtype=torch.bfloat16)

    def ar() -> None:
        dist.all_reduce(act)

    def mm() -> None:
        torch.mm(x, w, out=out)

    both = beside(ar, mm)

    inner, nbytes = args.inner, act.numel() * act.element_size()
    rows = {}
    if args.copy_engine:
        rows.update(copy_engine_rows(act, mm, args.reps, inner))
    cases = [("ar", ar, None), ("mm", mm, None), ("mm+ar", both, None)]
    for c in filter(None, args.carveouts.split(",")):
        cases += [(f"mm/{c}", mm, int(c)), (f"mm+ar/{c}", both, int(c))]
    for name, body, carveout in cases:
        torch._C._set_sm_carveout_experimental(carveout)
        rows[name] = measure(name, body, args.reps, inner)
    torch._C._set_sm_carveout_experimental(None)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        busbw = nbytes * 2 * (world - 1) / world / (rows["ar"][1] * 1e-6) / 1e9
        print(f"{torch.cuda.get_device_name()} x{world}, activation {t}x{h} bf16 "
              f"({nbytes / 1e6:.1f} MB), median of {args.reps} x {inner}, µs each")
        print(f"{'':8} {'eager':>8} {'graph':>8}")
        for name, (eager, graph) in rows.items():
            print(f"{name:8} {eager:8.1f} {graph:8.1f}")
        if args.copy_engine:
            for col, how in ((0, "eager"), (1, "graph")):
                hidden = rows["ce"][col] + rows["mm"][col] - rows["mm+ce"][col]
                print(f"mm+ce: {hidden:.1f} µs of the two hidden ({how})")
        print(f"all-reduce bus bandwidth in a graph {busbw:.0f} GB/s")
        for name in rows:
            if name.startswith("mm+ar"):
                alone = rows["ar"][1] + rows[name.replace("+ar", "")][1]
                print(f"{name}: {alone - rows[name][1]:.1f} µs of the two hidden")
        print(json.dumps({"benchmark": "allreduce", "device": torch.cuda.get_device_name(),
                          "world": world, "bytes": nbytes,
                          "nccl_env": {k: v for k, v in os.environ.items()
                                       if k.startswith(("NCCL_", "TORCH_NCCL_"))},
                          "carveouts": args.carveouts,
                          **{f"{k}_us": round(v[1], 1) for k, v in rows.items() if v[1] == v[1]},
                          **{f"{k}_eager_us": round(v[0], 1) for k, v in rows.items()},
                          "busbw_gbs": round(busbw)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
