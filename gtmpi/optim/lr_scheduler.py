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
