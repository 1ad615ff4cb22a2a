"""Optimizers with torch's update rules, applied in place on the workers under no_grad (never
recorded on a graph; no tensor data reaches the client): one multi-tensor instruction per
group of parameters that live alike (ops/table.py: sgd_foreach, adam_foreach), with torch's
foreach arithmetic (Adam's fused kernel on GPU workers)."""
from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch

from ..autograd import no_grad, zero_grads
from ..client.creation import beside, tensor
from ..client.replay import Repeated, as_is, capture_enabled, repeated_at
from ..client.runtime import Runtime, runtime
from ..client.tensor import Tensor, apply
from .zero import gather as zero_gather
from .zero import level as zero_level
from .zero import pieces as zero_pieces
from .zero import shard as zero_shard
from .zero import zero_state


class Optimizer:
    def __init__(self, params: Iterable, defaults: dict[str, Any]):
        if isinstance(params, Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of "
                            "Tensors or dicts, but got a gtmpi.Tensor")
        self.defaults = defaults
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = [{**defaults, **g, "params": _tensors(g["params"])} for g in groups]
        for group in self.param_groups:
            self.check(group)
        # keyed by the parameter, as torch's: opt.state[p] is p's state ({} before its first
        # step), never a KeyError
        self.state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        self._repeated: dict[str, Repeated] = {}  # the step captured, per call site
        zero_shard([p for group in self.param_groups for p in group["params"]])

    def check(self, group: dict) -> None:
        """torch's checks of hyper-parameters, at construction rather than at step()."""
        if not 0.0 <= group["lr"]:
            raise ValueError(f"Invalid learning rate: {group['lr']}")
        if not 0.0 <= group["weight_decay"]:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads((p for group in self.param_groups for p in group["params"]), set_to_none)

    @no_grad()
    def step(self) -> None:
        rt = runtime()
        if not capture_enabled(rt):
            self._step(rt, as_is)
            return
        repeated = repeated_at(rt, f"{type(self).__name__}.step", self._repeated)
        run = functools.partial(self._step, rt)
        if type(self) not in _CAPTURED:  # what a subclass does besides its instructions
            repeated.as_written("a subclass of gtmpi's optimizers" if type(self).__module__ !=
                                __name__ else f"{type(self).__name__}'s update is not one "
                                "instruction yet", run)
            return
        key, grads, followed = self._key()
        repeated(rt, key, grads, followed, run, self._knob, self._advance)

    def _step(self, rt: Runtime, knob: Callable[[float, Any], float]) -> None:
        # each update agrees on its gradients' faults before writing (a failed batch leaves
        # every replica untouched); agreeing on all of them first makes that one host
        # barrier per step instead of one per group of parameters that live alike
        rt.agree([p.grad.id for group in self.param_groups for p in group["params"]
                  if p.grad is not None])
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            states = [self.state[p] for p in params]
            zero = [zero_level(p) for p in params]
            lr = knob(group["lr"], ("lr", index))
            for bucket in rt.alike([p.id for p in params],
                                   [(self.bucket_key(s), z) for s, z in zip(states, zero)]):
                mine, theirs = [params[i] for i in bucket], [states[i] for i in bucket]
                if not zero[bucket[0]]:
                    self.update(mine, theirs, group, lr, knob)
                    continue
                shards = zero_pieces(mine)  # ZeRO: each worker updates its piece (optim/zero.py)
                self.update(shards, theirs, group, lr, knob)
                if zero[bucket[0]] < 3:  # at 3 the weights are their pieces already
                    zero_gather(mine, shards, zero[bucket[0]])

    def _key(self) -> tuple[Any, list[Tensor], set[int]]:
        """What decides a step's instructions (Repeated's key): per group its constants, per
        parameter which tensor it is, and if it has a gradient, its shape and the state's
        tensors and counts (relative: every step moves them all); the gradients, which each
        step binds; the tensors from before the key names. Flat, in one loop: it runs every
        step."""
        key: list = []
        add = key.append
        grads, followed = [], set()
        base = None
        state_of = self.state.get
        for group in self.param_groups:
            add(tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in group.items()
                      if k != "params" and k != "lr"))
            for p in group["params"]:
                g = p.grad
                add(p.id)
                if g is None:  # not updated: its state is no part of the step
                    add(None)
                    continue
                followed.add(p.id)
                add(g._sig)
                grads.append(g)
                state = state_of(p)
                if not state:
                    add(None)
                    continue
                for k, v in state.items():
                    add(k)
                    if isinstance(v, Tensor):
                        add(v.id)
                        followed.add(v.id)
                    elif k == "step":
                        base = v if base is None else base
                        add(v - base)
                    else:
                        add(v)
        return tuple(key), grads, followed

    def _knob(self, source: tuple) -> float:
        what, where = source
        return self.param_groups[where]["lr"] if what == "lr" else self.state[where]["step"]

    def _advance(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.advance(self.state[p])

    def advance(self, state: dict) -> None:
        """What an update does to a parameter's state on the client besides its instruction
        (a replayed step does only this)."""

    def bucket_key(self, state: dict) -> Any:
        """What parameters updated by one instruction must share besides their placement."""
        return None

    @no_grad()
    def init_state(self) -> None:
        """Every parameter's state as its first step would make it (zeros, placed where that
        step would place them: pieces under ZeRO), no weight changed: what a sharded
        checkpoint's state is loaded into in place (gtmpi.load_sharded, then
        load_state_dict), as torch.distributed.checkpoint makes it before loading. A step
        after it updates as the first step does."""
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self.state[p] = self.fresh(p, group)

    def fresh(self, p: Tensor, group: dict) -> dict:
        """``p``'s state before its first update."""
        return {}

    def stepped(self, params: list[Tensor], states: list[dict], group: dict) -> None:
        """Each state made at its parameter's first update, then advanced by this one."""
        for p, state in zip(params, states):
            if not state:
                state.update(self.fresh(p, group))
            self.advance(state)

    def update(self, params: list[Tensor], states: list[dict], group: dict, lr: float,
               knob: Callable[[float, Any], float]) -> None:
        """One instruction updating ``params`` at rate ``lr``; ``knob`` (Repeated's) marks any
        other number that changes step to step."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """torch's layout: per-parameter state by the parameter's index over all groups (the
        step as a float tensor, as torch keeps it), and the groups' hyper-parameters with the
        indices of their parameters."""
        params = self._params()
        index = {id(p): i for i, p in enumerate(params)}
        steps = self._steps_done([p for p in params if "exp_avg" in self.state.get(p, ())])
        state = {index[id(p)]: {k: torch.tensor(float(steps.get(p, v))) if k == "step"
                                else v for k, v in self.state[p].items()}
                 for p in params if self.state.get(p)}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's or gtmpi's state_dict (its tensors torch's or gtmpi's): each state tensor is
        made where its parameter lives."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for mine, theirs in zip(self.param_groups, groups):
            if len(mine["params"]) != len(theirs["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't "
                                 "match the size of optimizer's group")
        params = self._params()
        own, self.state = self.state, defaultdict(dict)
        with no_grad():
            for i, entry in state_dict["state"].items():
                p = params[int(i)]
                before, mine = own.get(p, {}), {}
                self.state[p] = mine
                for k, v in entry.items():
                    if k == "step":
                        mine[k] = int(v.item() if hasattr(v, "item") else v)
                        continue
                    if v is before.get(k):  # this optimizer's own, filled in place (load_sharded)
                        mine[k] = v
                        continue
                    host = v.cpu_torch() if isinstance(v, Tensor) else torch.as_tensor(v)
                    with beside(p):
                        mine[k] = tensor(host, dtype=p.dtype)
        for mine, theirs in zip(self.param_groups, groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})

    def _steps_done(self, params: list[Tensor]) -> dict[Tensor, int]:
        """param -> the updates its worker ran: the client counts every step() it issued,
        the worker only the updates it did not skip for a failed batch (ops/table.py:
        _adam_foreach), and a checkpoint must resume with the bias corrections of the latter."""
        steps: dict[Tensor, int] = {}
        for group in runtime().alike([p.id for p in params], [None] * len(params)):
            avgs = [self.state[params[i]]["exp_avg"] for i in group]
            for i, n in zip(group, apply("adam_steps", *avgs).tolist()):
                if n >= 0:
                    steps[params[i]] = n
        return steps

    def _params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]


def _tensors(params: Any) -> list[Tensor]:
    params = [params] if isinstance(params, Tensor) else list(params)
    for p in params:
        if not isinstance(p, Tensor):
            raise TypeError("optimizer can only optimize Tensors, but one of the params is "
                            f"{type(p).__name__}")
        if p._node is not None:
            raise ValueError("can't optimize a non-leaf Tensor")
    return params


class SGD(Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def check(self, group: dict) -> None:
        super().check(group)
        if group["momentum"] < 0.0:
            raise ValueError(f"Invalid momentum value: {group['momentum']}")

    def bucket_key(self, state: dict) -> Any:
        return "momentum_buffer" in state  # a buffer's first step copies the gradient

    def fresh(self, p: Tensor, group: dict) -> dict:
        return {"momentum_buffer": zero_state(p)} if group["momentum"] else {}

    def update(self, params: list[Tensor], states: list[dict], group: dict, lr: float,
               knob: Callable[[float, Any], float]) -> None:
        bufs = []
        first = False
        if group["momentum"]:
            first = "momentum_buffer" not in states[0]
            if first:
                for p, state in zip(params, states):
                    state.update(self.fresh(p, group))
            bufs = [state["momentum_buffer"] for state in states]
        apply("sgd_foreach", *params, *(p.grad for p in params), *bufs, lr,
              group["momentum"], group["dampening"], group["weight_decay"], group["nesterov"],
              first)


class Adam(Optimizer):
    """torch.optim.Adam's update. ``fused`` as torch's: True, torch's fused kernel; False, its
    foreach arithmetic; None (the default), the fused kernel on GPU workers and foreach on CPU
    workers (ops/table.py: _adam_foreach)."""
    decoupled = False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, fused: bool | None = None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      fused=fused))

    def check(self, group: dict) -> None:
        super().check(group)
        if not 0.0 <= group["eps"]:
            raise ValueError(f"Invalid epsilon value: {group['eps']}")
        for i, beta in enumerate(group["betas"]):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")

    def bucket_key(self, state: dict) -> Any:
        return state.get("step", 0)  # bias corrections depend on it

    def fresh(self, p: Tensor, group: dict) -> dict:
        return {"step": 0, "exp_avg": zero_state(p), "exp_avg_sq": zero_state(p)}

    def advance(self, state: dict) -> None:
        state["step"] += 1

    def update(self, params: list[Tensor], states: list[dict], group: dict, lr: float,
               knob: Callable[[float, Any], float]) -> None:
        self.stepped(params, states, group)
        b1, b2 = group["betas"]
        apply("adam_foreach", *params, *(p.grad for p in params),
              *(s["exp_avg"] for s in states), *(s["exp_avg_sq"] for s in states), lr,
              b1, b2, group["eps"], group["weight_decay"], self.decoupled,
              knob(states[0]["step"], ("step", params[0])), group.get("fused"))


class AdamW(Adam):
    decoupled = True

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, fused: bool | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, fused=fused)


class _Elementwise(Optimizer):
    """An optimizer whose update is the table's elementwise ops, parameter by parameter, in
    torch's order of arithmetic (no foreach kernel of its own yet): its steps run as written,
    not captured."""

    def advance(self, state: dict) -> None:
        state["step"] += 1

    def update(self, params: list[Tensor], states: list[dict], group: dict, lr: float,
               knob: Callable[[float, Any], float]) -> None:
        self.stepped(params, states, group)
        for p, state in zip(params, states):
            grad = p.grad if not group["weight_decay"] else p.grad + group["weight_decay"] * p
            self.each(p, grad, state, group, lr)

    def each(self, p: Tensor, grad: Tensor, state: dict, group: dict, lr: float) -> None:
        raise NotImplementedError


class RMSprop(_Elementwise):
    def __init__(self, params: Iterable, lr: float = 1e-2, alpha: float = 0.99,
                 eps: float = 1e-8, weight_decay: float = 0.0, momentum: float = 0.0,
                 centered: bool = False):
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                                      momentum=momentum, centered=centered))

    def check(self, group: dict) -> None:
        super().check(group)
        for name in ("eps", "momentum", "alpha"):
            if not 0.0 <= group[name]:
                raise ValueError(f"Invalid {'epsilon' if name == 'eps' else name} value: "
                                 f"{group[name]}")

    def fresh(self, p: Tensor, group: dict) -> dict:
        state = {"step": 0, "square_avg": zero_state(p)}
        if group["momentum"] > 0:
            state["momentum_buffer"] = zero_state(p)
        if group["centered"]:
            state["grad_avg"] = zero_state(p)
        return state

    def each(self, p: Tensor, grad: Tensor, state: dict, group: dict, lr: float) -> None:
        alpha = group["alpha"]
        square_avg = state["square_avg"]
        square_avg.mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
        if group["centered"]:
            grad_avg = state["grad_avg"]
            grad_avg.lerp_(grad, 1 - alpha)
            avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt() + group["eps"]
        else:
            avg = square_avg.sqrt() + group["eps"]
        if group["momentum"] > 0:
            buf = state["momentum_buffer"]
            buf.mul_(group["momentum"]).addcdiv_(grad, avg)
            p.add_(buf, alpha=-lr)
        else:
            p.addcdiv_(grad, avg, value=-lr)


class Adagrad(_Elementwise):
    def __init__(self, params: Iterable, lr: float = 1e-2, lr_decay: float = 0.0,
                 weight_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value,
                                      eps=eps))

    def check(self, group: dict) -> None:
        super().check(group)
        for name in ("lr_decay", "initial_accumulator_value", "eps"):
            if not 0.0 <= group[name]:
                raise ValueError(f"Invalid {name} value: {group[name]}")

    def fresh(self, p: Tensor, group: dict) -> dict:
        accumulated = zero_state(p)
        if group["initial_accumulator_value"]:
            accumulated.add_(group["initial_accumulator_value"])
        return {"step": 0, "sum": accumulated}

    def each(self, p: Tensor, grad: Tensor, state: dict, group: dict, lr: float) -> None:
        rate = lr / (1 + (state["step"] - 1) * group["lr_decay"])
        state["sum"].addcmul_(grad, grad, value=1)
        p.addcdiv_(grad, state["sum"].sqrt() + group["eps"], value=-rate)


# the optimizers whose advance() is all a step does on the client besides its instructions
_CAPTURED = (SGD, Adam, AdamW)
