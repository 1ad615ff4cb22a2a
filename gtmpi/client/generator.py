"""torch.Generator for random ops: the CPU's is torch's own; a GPU's stands for the workers'.

torch draws a tensor made on the CPU from a CPU generator and one made on a GPU from that
GPU's. gtmpi does the same: a host-held tensor (client/host.py) is drawn by torch's CPU
generator (the default one, or the ``torch.Generator()`` passed), so its numbers are torch's.
A worker's random op gets a seed of its own (the same numbers on any number of workers); a
``Generator(device="cuda")`` passed to it gives those seeds from its own seed and count
instead of the session's, so that a sampling loop seeded by its generator repeats.
"""
from __future__ import annotations

from typing import Any

import torch

from ..ops.table import derive_seed
from .runtime import runtime


class Generator:
    """torch.Generator's API. ``device`` none or the CPU: torch's own generator is returned."""

    def __new__(cls, device: Any = None) -> Any:
        if device is None or torch.device(device).type == "cpu":
            return HostGenerator()
        return super().__new__(cls)

    def __init__(self, device: Any = None) -> None:
        self.device = torch.device(device)
        self._seed = 67280421310721  # torch's default seed
        self._count = 0

    def manual_seed(self, seed: int) -> "Generator":
        self._seed, self._count = int(seed), 0
        return self

    def seed(self) -> int:
        return self.manual_seed(_draw_seed(None))._seed

    def initial_seed(self) -> int:
        return self._seed

    def get_state(self) -> torch.Tensor:
        return torch.tensor([self._seed, self._count], dtype=torch.int64)

    def set_state(self, state: Any) -> "Generator":
        self._seed, self._count = (int(v) for v in state.tolist())
        return self

    def next_seed(self) -> int:
        self._count += 1
        return derive_seed(self._seed, self._count)


class HostGenerator(torch.Generator):
    """torch's CPU generator, whose set_state also takes the state as gtmpi.load gives it
    back (a tensor on the workers, read here)."""

    def set_state(self, state: Any) -> "HostGenerator":
        return super().set_state(host_state(state))


def host_state(state: Any) -> torch.Tensor:
    """A generator's state as torch takes it: a gtmpi tensor (gtmpi.load's) read back."""
    return state.cpu_torch() if hasattr(state, "cpu_torch") else state


def host_generator(generator: Any) -> torch.Generator | None:
    """The torch generator a host draw uses (None: torch's default CPU one)."""
    return generator if isinstance(generator, torch.Generator) else None


def worker_seed(generator: Any = None) -> int:
    """The seed of a worker's random op: the session's next, or the generator's. A CPU
    generator passed for a worker's op gives one draw of its own stream."""
    if generator is None:
        return runtime().next_seed()
    if isinstance(generator, Generator):
        return generator.next_seed()
    return _draw_seed(generator)


def _draw_seed(generator: torch.Generator | None) -> int:
    """A fresh seed from a CPU generator's stream (None: torch's default one)."""
    return int(torch.randint(0, 1 << 62, (1,), generator=generator))
