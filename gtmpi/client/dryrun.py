"""A dry run: a program run against N simulated workers, to learn before a job what it will do.

    GTMPI_DRY_RUN=8 GTMPI_CONFIG=configs/gpt_tp2_pp4.yaml python examples/gpt/train.py --size mini

The client and the dispatcher run as they always do: every placement decision, every
collective and transfer they insert, every instruction a worker gets. The N workers are
executors in this process on meta tensors (shapes and dtypes, no data): every kernel runs for
its result's shape, collectives through worker/metaplane.py, which counts them with their
bytes as a real run's data plane does. The workers say they are GPUs (``GTMPI_DRY_RUN_GPU``,
default H100), so a program takes its GPU paths (bf16, graphs are refused: meta has none).
Reads give zeros (said once): a training loop that prints its loss still runs.

At exit it prints, per worker: instructions, collectives and transfers by kind with bytes,
and its peak of tensor memory against the GPU's size: the most bytes of tensors alive at once,
counted as torch's ops make them and as their storages die (worker/metaplane.py), with the
GPU's fused kernels standing in where torch's meta path would keep more (attention, the
vocabulary-parallel cross-entropy), and with what the allocator holds besides: cuBLAS's
workspace per stream that runs matrix products, and a CUDA graph's capture keeping every
send's snapshot to its end (worker/metaplane.py). An estimate: the allocator's rounding is not
in it. Measured against GPT-2 small on H100s (benchmarks/RESULTS.md): DP=2 −0.3%, TP=2
−2.7%, TP=2 x PP=2 −5.9%; GPT-3 6.7B's shape, every block checkpointed, on H200s: one GPU
−0.3%, FSDP over 4 −0.8%. The client holds what the program makes without a device
(client/host.py) as meta above HOST_NUMEL, so a model larger than the client's own memory
plans too. A program's replays after its third are not run again:
the tensors they leave and the collectives they ran are those of the one before.
GTMPI_TRACE records it as any run: `gtmpi-trace comms` lists what was inserted where, and the
workers' instructions last what worker/costmodel.py estimates for the named GPU (arithmetic at
a share of its peak or memory traffic at a share of its bandwidth, collectives over NVLink):
estimates, with no overlap and no worker waiting for another.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
from typing import TYPE_CHECKING

import torch

from ..transport.local import LocalLink
from ..worker import costmodel
from .runtime import Runtime, current, set_default_start

if TYPE_CHECKING:
    from ..worker.metaplane import MetaExecutor

GPU_BYTES = {name: spec.memory for name, spec in costmodel.GPUS.items()}


def start_dry_run(workers: int, gpu: str) -> Runtime:
    if workers < 1:
        raise ValueError(f"GTMPI_DRY_RUN={workers}: a dry run needs at least one worker")
    if gpu not in GPU_BYTES:
        raise ValueError(f"GTMPI_DRY_RUN_GPU={gpu!r}: one of {', '.join(GPU_BYTES)}")
    # the meta workers' torch dispatch machinery costs every process's import a quarter second
    from ..worker.metaplane import MetaExecutor
    links, infos = {}, {}
    for rank in range(1, workers + 1):
        link = LocalLink()
        link.executor = MetaExecutor(rank, link, costmodel.GPUS[gpu], workers)
        links[rank] = link
        infos[rank] = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                       "device": f"cuda:{rank - 1}", "local_index": rank - 1,
                       "torch": torch.__version__, "embedded": True, "dry_run": gpu}
    print(f"gtmpi: dry run: {workers} simulated {gpu} worker(s) on meta tensors; values read "
          "are zeros, memory and collectives are what the program would ask for",
          file=sys.stderr, flush=True)
    executors = [link.executor for link in links.values()]
    atexit.register(_report, executors, gpu)
    return Runtime(links, infos)


def dry_run(workers: int, gpu: str = "H100") -> None:
    """gtmpi.dry_run(workers=N, gpu="H100"): what GTMPI_DRY_RUN=N does, asked for in the
    program; before its first tensor, and not under an MPI launcher (whose ranks are real)."""
    if current() is not None:
        raise RuntimeError("gtmpi.dry_run() must come before the program's first tensor: a "
                           "session with real workers has started (under mpiexec, at import)")
    if gpu not in GPU_BYTES:
        raise ValueError(f"gpu={gpu!r}: one of {', '.join(GPU_BYTES)}")
    set_default_start(lambda: start_dry_run(workers, gpu))


def report(executors: list[MetaExecutor], gpu: str) -> list[dict]:
    """Per worker: instructions, collectives (kind -> count, bytes), peak tensor bytes."""
    return [{"rank": ex.rank, "instructions": ex.stats["ops"],
             "collectives": {k: tuple(v) for k, v in ex.plane.stats.items()},
             "peak_bytes": ex.meta_peak, "fits": ex.meta_peak <= GPU_BYTES[gpu]}
            for ex in executors]


def _report(executors: list[MetaExecutor], gpu: str) -> None:
    rows = report(executors, gpu)
    print(f"gtmpi dry run on {len(rows)} simulated {gpu}(s) of {GPU_BYTES[gpu] / 2 ** 30:.0f} "
          "GiB (peak: tensors alive at once, cuBLAS's workspaces, sends in flight; an "
          "estimate):", file=sys.stderr)
    for r in rows:
        comms = ", ".join(f"{k} {n} ({b / 1e6:.1f} MB)" for k, (n, b) in sorted(r["collectives"].items()))
        print(f"  worker {r['rank']}: {r['instructions']} instructions; peak "
              f"{r['peak_bytes'] / 2 ** 30:.2f} GiB{'' if r['fits'] else ' (DOES NOT FIT)'}; "
              f"{comms or 'no collectives'}", file=sys.stderr)
    sys.stderr.flush()
