"""A worker's GPU kernels over a few replayed calls, recorded by CUPTI (torch.profiler), for
what gtmpi's own trace cannot see: the kernels inside a CUDA graph, which the trace shows as
one launch, and the NCCL kernels waiting for a peer.

    GTMPI_PROFILE=DIR  GTMPI_PROFILE_REPLAYS=FIRST:COUNT  mpiexec ... python train.py

Each worker starts recording at the FIRST-th optimizer step it is sent (default 10) and stops
at the (FIRST+COUNT)-th (default COUNT 4), so the window holds COUNT whole steps of a training
loop, however many programs a step replays (a captured step: forward, backward, clipping) and
whether the optimizer's step is inside one or runs as written; benchmarks/real.py profiles
torch's own runs over the same steps. The GPU is drained at both ends, so no kernel of
another step leaks in. It writes DIR/worker<rank>.json (Chrome trace format), which
``python -m gtmpi.trace.kernels DIR`` sums up. Workers read the variables themselves: the
profile is a debugging aid of one run, not part of the instruction stream.
"""
from __future__ import annotations

import os

import torch

from ..ops.table import OPS, STEP_OPS

# an optimizer step's instructions: one step is a run of them (an update per parameter group,
# Adam's step counts between)
STEPS = frozenset(STEP_OPS) | {"adam_steps"}


class KernelProfiler:
    def __init__(self, rank: int, directory: str, first: int, count: int) -> None:
        self.rank, self.directory = rank, directory
        self.first, self.count = first, count
        self.steps = 0
        self.in_step = False  # the last op seen was a step's: the next of a step is that step
        self.profile = None
        # CUPTI sees the kernels inside a CUDA graph only if it was set up before the graph was
        # captured (pytorch#100441): a graph made before the window would show as one launch
        torch.profiler._utils._init_for_cuda_graphs()

    @classmethod
    def from_env(cls, rank: int, device: torch.device) -> "KernelProfiler | None":
        directory = os.environ.get("GTMPI_PROFILE")
        if not directory or device.type != "cuda":
            return None
        first, _, count = os.environ.get("GTMPI_PROFILE_REPLAYS", "10:4").partition(":")
        return cls(rank, directory, int(first), int(count or 4))

    def saw(self, instructions: list[tuple]) -> None:
        """Before a batch of the dispatcher's or a recorded program runs (or is launched as a
        graph): its optimizer steps move the window."""
        for ins in instructions:
            name = ins[0]
            if name in STEPS:
                if not self.in_step:
                    self.in_step = True
                    self.steps += 1
                    if self.steps == self.first:
                        torch.cuda.synchronize()
                        self.profile = torch.profiler.profile(
                            activities=[torch.profiler.ProfilerActivity.CUDA])
                        self.profile.__enter__()
                    elif self.steps == self.first + self.count:
                        self.close()
            elif name in OPS:
                self.in_step = False

    def close(self) -> None:
        """Stop and write the file (also at shutdown, if the run had fewer calls)."""
        if self.profile is None:
            return
        torch.cuda.synchronize()
        self.profile.__exit__(None, None, None)
        os.makedirs(self.directory, exist_ok=True)
        self.profile.export_chrome_trace(os.path.join(self.directory, f"worker{self.rank}.json"))
        self.profile = None


class MemoryHistory:
    """GTMPI_MEMORY_HISTORY=DIR: a GPU worker records every allocation and free of its device
    (torch's memory history, with Python stacks) from its start, and writes
    DIR/worker<rank>.pickle when it ends; ``python -m gtmpi.trace.memory DIR`` says what was
    live at the peak (inside CUDA graph captures too, where max_memory_allocated counts the
    graphs' pools)."""

    def __init__(self, rank: int, directory: str) -> None:
        self.rank, self.directory = rank, directory
        torch.cuda.memory._record_memory_history(max_entries=4_000_000)

    @classmethod
    def from_env(cls, rank: int, device: torch.device) -> "MemoryHistory | None":
        directory = os.environ.get("GTMPI_MEMORY_HISTORY")
        return cls(rank, directory) if directory and device.type == "cuda" else None

    def close(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        torch.cuda.memory._dump_snapshot(os.path.join(self.directory, f"worker{self.rank}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)
