"""Learning-rate schedules: they set each param group's lr from its initial lr."""
from __future__ import annotations

import math
from typing import Callable

from .optimizer import Optimizer


class LambdaLR:
    def __init__(self, optimizer: Optimizer, lr_lambda: Callable[[int], float]):
        self.optimizer = optimizer
        self.lr_lambda = lr_lambda
        self.base_lrs = [g.setdefault("initial_lr", g["lr"]) for g in optimizer.param_groups]
        self.last_epoch = 0
        self._apply()

    def _apply(self) -> None:
        factor = self.lr_lambda(self.last_epoch)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]


class CosineWithWarmup(LambdaLR):
    """Linear warm-up from 0 over ``warmup_steps``, then a cosine decay to
    ``min_lr_ratio`` of the initial lr at ``total_steps``."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int, total_steps: int,
                 min_lr_ratio: float = 0.0):
        def factor(step: int) -> float:
            if step < warmup_steps:
                return (step + 1) / warmup_steps
            progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        super().__init__(optimizer, factor)


class _Closed(LambdaLR):
    """A schedule of torch's given by its closed form: lr of a group from its initial lr and
    the step count (torch's own implementations agree with these up to rounding)."""

    def lr(self, base: float, epoch: int) -> float:
        raise NotImplementedError

    def __init__(self, optimizer: Optimizer):
        super().__init__(optimizer, lambda epoch: 1.0)

    def _apply(self) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = self.lr(base, self.last_epoch)


class StepLR(_Closed):
    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1):
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer)

    def lr(self, base: float, epoch: int) -> float:
        return base * self.gamma ** (epoch // self.step_size)


class ExponentialLR(_Closed):
    def __init__(self, optimizer: Optimizer, gamma: float):
        self.gamma = gamma
        super().__init__(optimizer)

    def lr(self, base: float, epoch: int) -> float:
        return base * self.gamma ** epoch


class LinearLR(_Closed):
    def __init__(self, optimizer: Optimizer, start_factor: float = 1.0 / 3,
                 end_factor: float = 1.0, total_iters: int = 5):
        self.start_factor, self.end_factor, self.total_iters = \
            start_factor, end_factor, total_iters
        super().__init__(optimizer)

    def lr(self, base: float, epoch: int) -> float:
        done = min(epoch, self.total_iters) / self.total_iters
        return base * (self.start_factor + (self.end_factor - self.start_factor) * done)


class CosineAnnealingLR(_Closed):
    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0):
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(optimizer)

    def lr(self, base: float, epoch: int) -> float:
        return self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * epoch / self.T_max)) / 2
