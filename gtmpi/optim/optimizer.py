"""Optimizers with torch's update rules, applied in place on the workers under no_grad (never
recorded on a graph; no tensor data reaches the client): one fused instruction per parameter
(ops/table.py: sgd_step, adam_step)."""
from __future__ import annotations

from typing import Any, Iterable

from ..autograd import no_grad, zero_grads
from ..client.creation import zeros_like
from ..client.tensor import Tensor, apply


class Optimizer:
    def __init__(self, params: Iterable, defaults: dict[str, Any]):
        self.defaults = defaults
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[int, dict[str, Any]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads((p for group in self.param_groups for p in group["params"]), set_to_none)

    @no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, p.grad, self.state.setdefault(id(p), {}), group)

    def update(self, p: Tensor, g: Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}


class SGD(Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def update(self, p, g, state, group):
        buf = None
        first = False
        if group["momentum"]:
            buf = state.get("momentum_buffer")
            first = buf is None
            if first:
                buf = state["momentum_buffer"] = zeros_like(p)
        apply("sgd_step", p, g, buf, group["lr"], group["momentum"], group["dampening"],
              group["weight_decay"], group["nesterov"], first)


class Adam(Optimizer):
    decoupled = False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def update(self, p, g, state, group):
        if not state:
            state["step"] = 0
            state["exp_avg"] = zeros_like(p)
            state["exp_avg_sq"] = zeros_like(p)
        state["step"] += 1
        b1, b2 = group["betas"]
        apply("adam_step", p, g, state["exp_avg"], state["exp_avg_sq"], group["lr"], b1, b2,
              group["eps"], group["weight_decay"], self.decoupled, state["step"])


class AdamW(Adam):
    decoupled = True

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, lr, betas, eps, weight_decay)
