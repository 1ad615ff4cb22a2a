"""Compiled replay (GTMPI_COMPILE): a recorded program traced whole into one graph of aten ops
and compiled by Inductor, then captured as a CUDA graph as any program is (worker/graphs.py).

Replayed as it is, a program runs one eager kernel per op, inside a CUDA graph: the pointwise
traffic around the matmuls (layer norms, GELU, residual adds, the loss's softmax) goes through
memory once per op, and every intermediate is kept. Known whole before it runs, the program is
what a compiler wants, forward, backward or optimizer step alike.

The trace (make_fx over fake tensors: nothing runs, nothing is written):
  inputs   the program's bound inputs and what it reads from before, a placeholder each; a
           fused op's record among them (a forward's, read by its backward) is its operands
  ops      each instruction's kernel from ops/table.py, as eager replay runs it, but a fused op
           with gradients keeps a Redo (its operands) instead of torch's autograd record: the
           backward recomputes the op under autograd, traced, so Inductor fuses the
           recomputation (a layer norm's statistics, a loss's softmax) into the backward
  writes   in-place ops on inputs (an optimizer's update, gradients accumulated) stay in the
           graph, which Inductor functionalizes and copies back to the inputs at the end
  outputs  what the program leaves that eager replay would leave: each tensor it makes and
           does not free, and the operands of the records it makes
  random   dropout's mask and rand draw from a counter-based hash of their seed and each
           element's index (splitmix64), traced as integer arithmetic that Inductor fuses into
           their users; each op's seed is an input of the program, a buffer set before each
           launch to the seed it gets as written (ops/table.py derive_seed): the same seed
           draws the same numbers run after run, not torch's numbers
Refused with the reason, and replayed as today: control words but frees, collectives, other
random ops (randn, randint, multinomial, attention's dropout), kernels that talk to other
workers, a read of an autograd record of an uncompiled program, and whatever the trace or
Inductor raises.

Modes (GTMPI_COMPILE, read on rank 0 and sent with each capture): 0 (the default: off), 1
(Inductor), fx (the traced graph run as it is: the translation checked against eager replay on
CPU workers, tests/test_compile.py). Inductor keeps what it compiled in its cache on disk
(TORCHINDUCTOR_CACHE_DIR), so a second run of the same program skips the compile.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterator

import torch

from ..ops.table import FUSED_FNS, OPS, SAVED_FORMS, Graph, Kind, Redo, Seed, derive_seed
from . import graphs

_ACROSS = ("group", "plane", "offset")  # keywords of kernels that split work over workers


def refusal(program: list[tuple]) -> str | None:
    """Why ``program`` cannot be compiled, from its instructions alone, or None."""
    for i, _, _ in graphs.seeded(program):
        if program[i][0] not in _COUNTED:
            return f"it draws random numbers by {program[i][0]}"
    for name, _, _, _, kw in program:
        op = OPS.get(name)
        if op is None:
            if name != "free":
                return f"it holds the control word '{name}'"
        elif op.kind is Kind.COMM:
            return f"it holds a collective ({name})"
        elif kw and any(kw.get(k) is not None for k in _ACROSS):
            return f"its {name} talks to other workers"
    return None


class Compiled:
    """One program compiled: run(env) does what running its instructions on ``env`` does."""

    def __init__(self, fn: Callable[..., Any], inputs: list[tuple[int, Any]],
                 outputs: list[tuple[int, Any]], freed: list[int], seconds: float,
                 mode: str, seeds: list[tuple[int, torch.Tensor]]) -> None:
        self.fn = fn
        self.inputs = inputs  # (id, layout): what each input is (_flat)
        self.seeds = seeds  # each random op's (offset among the call's, its seed's buffer)
        self.outputs = outputs  # (id, layout) of what it leaves
        self.freed = freed  # inputs the program frees
        self.seconds = seconds  # tracing and compiling
        self.mode = mode

    def seed(self, seeds: tuple[int, int] | None) -> None:
        """Before a launch: each random op's seed as written, from (session seed, count
        before the call)."""
        if self.seeds and seeds is not None:
            session, base = seeds
            for offset, buffer in self.seeds:
                buffer.fill_(derive_seed(session, base + offset))

    def run(self, env: dict[int, Any]) -> None:
        flat: list[torch.Tensor] = []
        for tid, _ in self.inputs:
            _flat(env[tid], flat)
        flat += [buffer for _, buffer in self.seeds]
        results = iter(self.fn(*flat))
        for tid, layout in self.outputs:
            env[tid] = _unflat(layout, results)
        for tid in self.freed:
            env.pop(tid, None)

    def note(self) -> str:
        how = "Inductor" if self.mode == "inductor" else "its traced graph (GTMPI_COMPILE=fx)"
        return f"compiled by {how} in {self.seconds:.1f} s"


def compile_program(program: list[tuple], inputs: list[int], env: dict[int, Any],
                    mode: str, device: torch.device) -> Compiled:
    """``program`` (its sizes and seeds given) compiled for the values ``env`` holds now under
    ``inputs`` (the ids it binds and reads from before). Raises with the reason where it
    cannot be."""
    why = refusal(program)
    if why is not None:
        raise RuntimeError(why)
    start = time.perf_counter()
    layouts, flat = [], []
    for tid in inputs:
        value = env[tid]
        if isinstance(value, Graph) and not isinstance(value, Redo):
            raise RuntimeError(f"it reads torch's autograd record {tid}, made by a program "
                               "replayed uncompiled")
        layouts.append((tid, _layout(value)))
        _flat(value, flat)
    seeds = [(program[i][2][j].offset, torch.zeros((), dtype=torch.int64, device=device))
             for i, at, _ in graphs.seeded(program) for j in at]
    flat += [buffer for _, buffer in seeds]
    made: dict[str, Any] = {}
    fn = _function(program, layouts, made, device, len(seeds))
    from torch.fx.experimental.proxy_tensor import make_fx
    traced = make_fx(fn, tracing_mode="fake")(*flat)
    if mode == "inductor":
        from torch._inductor import compile as inductor
        run = inductor(traced, flat)
        if device.type == "cuda":  # its first call loads its kernels, which a capture cannot
            run(*[t.clone() for t in flat])
            torch.cuda.synchronize(device)
    else:
        run = traced
    return Compiled(run, layouts, made["outputs"], made["freed"],
                    time.perf_counter() - start, mode, seeds)


def _function(program: list[tuple], layouts: list[tuple[int, Any]], made: dict[str, Any],
              device: torch.device, seeded: int) -> Callable[..., list[torch.Tensor]]:
    """The program as a function of its flat inputs (the last ``seeded`` its random ops'
    seeds, in order), returning its flat outputs; what the outputs are (their ids and
    layouts) and which inputs it frees go into ``made``."""
    def run(*flat: torch.Tensor) -> list[torch.Tensor]:
        it = iter(flat[:len(flat) - seeded])
        seeds = iter(flat[len(flat) - seeded:])
        env = {tid: _unflat(layout, it) for tid, layout in layouts}
        given = dict(env)
        for name, out, args, tmask, kw in program:
            if name == "free":
                for tid in args:
                    env.pop(tid, None)
                continue
            op = OPS[name]
            if tmask:
                args = [env[a] if tmask >> i & 1 else a for i, a in enumerate(args)]
            if op.kind is Kind.CREATE:
                kw = {**(kw or {}), "device": device}
            if name in _COUNTED:
                args = [next(seeds) if type(a) is Seed else a for a in args]
                res = _COUNTED[name](*args, **kw)
            elif name in FUSED_FNS and kw and kw.get("grads"):
                res = _redone(name, args, kw)
            else:
                res = op.kernel(*args, **kw) if kw else op.kernel(*args)
            if type(out) is int:
                env[out] = res
            else:
                env.update(zip(out, res))
        outputs, tensors = [], []
        for tid, value in env.items():
            if given.get(tid) is not value:
                outputs.append((tid, _layout(value)))
                _flat(value, tensors)
        made["outputs"] = outputs
        made["freed"] = [tid for tid in given if tid not in env]
        return tensors
    return run


def _redone(name: str, args: list, kw: dict) -> tuple[Any, Redo]:
    """A fused op with gradients: its result and its Redo record (ops/table.py)."""
    fn, grads = FUSED_FNS[name], kw["grads"]
    rest = {k: v for k, v in kw.items() if k != "grads"}
    forms = SAVED_FORMS.get(name)
    with torch.no_grad():
        made = forms[0](*args, **rest) if forms else None
        if made is not None:
            return made[0], Redo(fn, tuple(args), rest, grads, made[1], forms[1])
        return fn(*args, **rest), Redo(fn, tuple(args), rest, grads)


# splitmix64's constants as int64 (torch's integers are signed; products wrap)
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                                 0x94D049BB133111EB))


def _shifted(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z >> bits as unsigned (torch shifts int64 arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _uniform(shape: tuple, seed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """float32 numbers in [0, 1), one per element of ``shape``, from splitmix64 of the seed
    and the element's index: elementwise integer arithmetic, fused by Inductor."""
    z = torch.arange(math.prod(shape), dtype=torch.int64, device=device) * _GOLDEN + seed
    z = (z ^ _shifted(z, 30)) * _MIX1
    z = (z ^ _shifted(z, 27)) * _MIX2
    z = z ^ _shifted(z, 31)
    return (_shifted(z, 40).to(torch.float32) * 2.0 ** -24).view(shape)


# the random ops a compiled program draws by counting: the kernels of their table rows with a
# seed tensor in place of the seed
_COUNTED = {
    "dropout_mask": lambda shape, p, seed, device: _uniform(shape, seed, device) >= p,
    "rand": lambda shape, dtype, seed, device: _uniform(shape, seed, device).to(dtype),
}


_TENSOR, _NONE = "tensor", "none"
_HOLLOW = torch.empty(0, device="meta")


def _layout(value: Any) -> Any:
    """How a value is kept as flat tensors: a tensor itself, a Redo its operands, None none."""
    if isinstance(value, torch.Tensor):
        return _TENSOR
    if value is None:
        return _NONE
    if isinstance(value, Redo):  # its operands' places, not the tensors (kept alive)
        return value.with_tensors([_HOLLOW] * len(value.leaves))
    raise RuntimeError(f"it makes or reads a {type(value).__name__}, which a compiled program "
                       "cannot keep")


def _flat(value: Any, into: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        into.append(value)
    elif isinstance(value, Redo):
        into.extend(value.leaves)


def _unflat(layout: Any, it: Iterator[torch.Tensor]) -> Any:
    if layout is _TENSOR:
        return next(it)
    if layout is _NONE:
        return None
    return layout.with_tensors([next(it) for _ in layout.leaves])
