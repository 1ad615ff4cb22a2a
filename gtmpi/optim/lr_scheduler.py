"""Learning-rate schedules: they set each param group's lr from its initial lr."""
from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter
from typing import Any, Callable

from .optimizer import Optimizer

# a schedule's functions (a lambda is the program's code, saved by no one), lists of them too
_FUNCTIONS = ("lr_lambda", "lr_lambdas")


class _Saved:
    """torch's state_dict()/load_state_dict() of a schedule: its own attributes, less the
    optimizer and functions. A torch schedule's state loads too: the keys this one has are
    taken, torch's own extras left."""

    def state_dict(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items()
                 if k != "optimizer" and k not in _FUNCTIONS and not callable(v)}
        if isinstance(self, LambdaLR):  # what torch's LambdaLR.load_state_dict pops and reads
            state.update(lr_lambdas=[None] * len(self.base_lrs), _last_lr=self.get_last_lr())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__.update((k, v) for k, v in state_dict.items() if k in self.__dict__ and
                             k not in _FUNCTIONS and not callable(self.__dict__[k]))


class LambdaLR(_Saved):
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

    def restart(self) -> None:
        """Back to step 0, as SequentialLR starts a schedule at its milestone (torch's
        _update_lr(0))."""
        self.last_epoch = 0
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


class MultiStepLR(_Closed):
    def __init__(self, optimizer: Optimizer, milestones: list[int], gamma: float = 0.1):
        self.milestones, self.gamma = Counter(milestones), gamma  # torch's attributes
        super().__init__(optimizer)

    def lr(self, base: float, epoch: int) -> float:
        return base * self.gamma ** bisect_right(sorted(self.milestones.elements()), epoch)


class ConstantLR(_Closed):
    def __init__(self, optimizer: Optimizer, factor: float = 1.0 / 3, total_iters: int = 5):
        if factor > 1.0 or factor < 0:
            raise ValueError("Constant multiplicative factor expected to be between 0 and 1.")
        self.factor, self.total_iters = factor, total_iters
        super().__init__(optimizer)

    def lr(self, base: float, epoch: int) -> float:
        return base * (self.factor + (epoch >= self.total_iters) * (1 - self.factor))


class PolynomialLR(_Closed):
    def __init__(self, optimizer: Optimizer, total_iters: int = 5, power: float = 1.0):
        self.total_iters, self.power = total_iters, power
        super().__init__(optimizer)

    def lr(self, base: float, epoch: int) -> float:
        return base * (1.0 - min(self.total_iters, epoch) / self.total_iters) ** self.power


class MultiplicativeLR(LambdaLR):
    """Each step multiplies each group's lr by its function of the step count (step 0
    leaves it)."""

    def __init__(self, optimizer: Optimizer,
                 lr_lambda: Callable[[int], float] | list[Callable[[int], float]]):
        groups = optimizer.param_groups
        self.lr_lambdas = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else \
            [lr_lambda] * len(groups)
        if len(self.lr_lambdas) != len(groups):
            raise ValueError(f"Expected {len(groups)} lr_lambdas, but got "
                             f"{len(self.lr_lambdas)}")
        super().__init__(optimizer, lambda epoch: 1.0)

    def _apply(self) -> None:
        if self.last_epoch > 0:
            self._multiply()

    def restart(self) -> None:
        self.last_epoch = 0  # torch's at a SequentialLR's milestone: step 0's factor too
        self._multiply()

    def _multiply(self) -> None:
        for group, factor in zip(self.optimizer.param_groups, self.lr_lambdas):
            group["lr"] *= factor(self.last_epoch)


class CosineAnnealingWarmRestarts(LambdaLR):
    """Cosine annealing from each group's initial lr to ``eta_min`` over ``T_0`` steps, then
    again from the top over ``T_0 * T_mult``, ``T_0 * T_mult ** 2``, ... steps; torch's
    counters (T_cur, T_i), so that either's state loads into the other."""

    def __init__(self, optimizer: Optimizer, T_0: int, T_mult: int = 1,
                 eta_min: float = 0.0):
        if T_0 <= 0 or not isinstance(T_0, int):
            raise ValueError(f"Expected positive integer T_0, but got {T_0}")
        if T_mult < 1 or not isinstance(T_mult, int):
            raise ValueError(f"Expected integer T_mult >= 1, but got {T_mult}")
        self.T_0, self.T_i, self.T_mult, self.eta_min, self.T_cur = T_0, T_0, T_mult, eta_min, 0
        super().__init__(optimizer, lambda epoch: 1.0)

    def step(self) -> None:
        self.last_epoch += 1
        self.T_cur += 1
        if self.T_cur >= self.T_i:
            self.T_cur %= self.T_i
            self.T_i *= self.T_mult
        self._apply()

    def restart(self) -> None:
        self.T_i, self.T_cur = self.T_0, 0
        super().restart()

    def _apply(self) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = self.eta_min + (base - self.eta_min) * \
                (1 + math.cos(math.pi * self.T_cur / self.T_i)) / 2


class SequentialLR(_Saved):
    """torch's: ``schedulers`` one after another, each from step 0 at its milestone (a
    warm-up, then a decay)."""

    def __init__(self, optimizer: Optimizer, schedulers: list[LambdaLR],
                 milestones: list[int]):
        if len(schedulers) < 1:
            raise ValueError(f"{type(self).__name__} expects at least one scheduler, but got "
                             "no scheduler.")
        for i, scheduler in enumerate(schedulers):
            if isinstance(scheduler, ReduceLROnPlateau):
                raise ValueError(f"{type(self).__name__} does not support `ReduceLROnPlateau` "
                                 "scheduler as it requires additional kwargs to be specified "
                                 f"when calling `step`, but got one at index {i} in the "
                                 "given schedulers sequence.")
            if scheduler.optimizer is not optimizer:
                raise ValueError(f"{type(self).__name__} expects all schedulers to belong to "
                                 f"the same optimizer, but got scheduler "
                                 f"{type(scheduler).__name__} at index {i} has "
                                 f"{scheduler.optimizer}, which is different from "
                                 f"{type(optimizer).__name__}.")
        if len(milestones) != len(schedulers) - 1:
            raise ValueError("Sequential Schedulers expects number of schedulers provided to "
                             f"be one more than the number of milestone points, but got number "
                             f"of schedulers {len(schedulers)} and the number of milestones to "
                             f"be equal to {len(milestones)}")
        self.optimizer = optimizer
        self._schedulers, self._milestones = list(schedulers), list(milestones)
        self.last_epoch = 0
        for group in optimizer.param_groups:  # each schedule made set it: the first decides
            group["lr"] = group["initial_lr"]
        first = self._schedulers[bisect_right(self._milestones, 0)]
        first.restart()
        self._last_lr = first.get_last_lr()

    def step(self) -> None:
        self.last_epoch += 1
        at = bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[at]
        if at > 0 and self._milestones[at - 1] == self.last_epoch:
            scheduler.restart()
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_schedulers")}
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner = state_dict["_schedulers"]
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "_schedulers"})
        for scheduler, state in zip(self._schedulers, inner):
            scheduler.load_state_dict(state)


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


class OneCycleLR(LambdaLR):
    """torch's 1cycle policy: the lr rises from max_lr / div_factor to max_lr over pct_start of
    total_steps, then falls to that / final_div_factor (cosine or linear), the momentum (SGD's
    momentum, Adam's first beta) moving the opposite way between base_ and max_momentum."""

    def __init__(self, optimizer: Optimizer, max_lr: float | list[float],
                 total_steps: int | None = None, epochs: int | None = None,
                 steps_per_epoch: int | None = None, pct_start: float = 0.3,
                 anneal_strategy: str = "cos", cycle_momentum: bool = True,
                 base_momentum: float = 0.85, max_momentum: float = 0.95,
                 div_factor: float = 25.0, final_div_factor: float = 1e4,
                 three_phase: bool = False):
        if total_steps is None:
            if epochs is None or steps_per_epoch is None:
                raise ValueError("You must define either total_steps OR (epochs AND "
                                 "steps_per_epoch)")
            total_steps = epochs * steps_per_epoch
        if total_steps <= 0:
            raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be one of 'cos' or 'linear', instead got "
                             f"{anneal_strategy}")
        self.optimizer, self.total_steps = optimizer, total_steps
        self.anneal = _cos if anneal_strategy == "cos" else _linear
        groups = optimizer.param_groups
        peaks = max_lr if isinstance(max_lr, (list, tuple)) else [max_lr] * len(groups)
        ends = ([pct_start * total_steps - 1, 2 * pct_start * total_steps - 2, total_steps - 1]
                if three_phase else [pct_start * total_steps - 1, total_steps - 1])
        # per phase: its last step, and the (lr, momentum) keys it moves from and to
        keys = ([("initial_lr", "max_lr", "max_momentum", "base_momentum"),
                 ("max_lr", "initial_lr", "base_momentum", "max_momentum"),
                 ("initial_lr", "min_lr", "max_momentum", "max_momentum")] if three_phase else
                [("initial_lr", "max_lr", "max_momentum", "base_momentum"),
                 ("max_lr", "min_lr", "base_momentum", "max_momentum")])
        self.phases = list(zip(ends, keys))
        self.cycle_momentum = cycle_momentum
        for group, peak in zip(groups, peaks):
            group.update(initial_lr=peak / div_factor, max_lr=peak,
                         min_lr=peak / div_factor / final_div_factor)
            if cycle_momentum:
                group.update(max_momentum=max_momentum, base_momentum=base_momentum)
        self.base_lrs = [g["initial_lr"] for g in groups]
        self.last_epoch = 0
        self._apply()

    def _apply(self) -> None:
        step = self.last_epoch
        if step > self.total_steps:
            raise ValueError(f"Tried to step {step} times. The specified number of total steps "
                             f"is {self.total_steps}")
        for group in self.optimizer.param_groups:
            start = 0
            for i, (end, (lr0, lr1, m0, m1)) in enumerate(self.phases):
                if step <= end or i == len(self.phases) - 1:
                    pct = (step - start) / (end - start)
                    group["lr"] = self.anneal(group[lr0], group[lr1], pct)
                    if self.cycle_momentum:
                        momentum = self.anneal(group[m0], group[m1], pct)
                        if "betas" in group:
                            group["betas"] = (momentum, *group["betas"][1:])
                        else:
                            group["momentum"] = momentum
                    break
                start = end


def _cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


def _linear(start: float, end: float, pct: float) -> float:
    return (end - start) * pct + start


class ReduceLROnPlateau(_Saved):
    """torch's: each group's lr times ``factor`` once the metric given to step() has not
    improved (by ``threshold``, relative or absolute) for more than ``patience`` steps, then
    ``cooldown`` steps of rest; never below ``min_lr``. A metric that is a tensor is read."""

    def __init__(self, optimizer: Optimizer, mode: str = "min", factor: float = 0.1,
                 patience: int = 10, threshold: float = 1e-4, threshold_mode: str = "rel",
                 cooldown: int = 0, min_lr: float | list[float] = 0.0, eps: float = 1e-8):
        if factor >= 1.0:
            raise ValueError("Factor should be < 1.0.")
        if mode not in ("min", "max"):
            raise ValueError(f"mode {mode} is unknown!")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold mode {threshold_mode} is unknown!")
        self.optimizer = optimizer
        groups = optimizer.param_groups
        self.min_lrs = list(min_lr) if isinstance(min_lr, (list, tuple)) else [min_lr] * len(groups)
        self.mode, self.factor, self.patience = mode, factor, patience
        self.threshold, self.threshold_mode = threshold, threshold_mode
        self.cooldown, self.eps = cooldown, eps
        self.best = math.inf if mode == "min" else -math.inf
        self.num_bad_epochs = self.cooldown_counter = self.last_epoch = 0
        self._last_lr = [g["lr"] for g in groups]

    def _better(self, value: float) -> bool:
        rel = self.threshold_mode == "rel"
        if self.mode == "min":
            return value < (self.best * (1 - self.threshold) if rel else self.best - self.threshold)
        return value > (self.best * (1 + self.threshold) if rel else self.best + self.threshold)

    def step(self, metrics: float | Any) -> None:
        current = float(metrics)
        self.last_epoch += 1
        if self._better(current):
            self.best, self.num_bad_epochs = current, 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            for group, floor in zip(self.optimizer.param_groups, self.min_lrs):
                new = max(group["lr"] * self.factor, floor)
                if group["lr"] - new > self.eps:
                    group["lr"] = new
            self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return self._last_lr
