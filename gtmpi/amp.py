"""torch.amp on gtmpi: autocast and GradScaler, with torch's semantics.

    with gtmpi.autocast(device_type="cuda", dtype=gtmpi.bfloat16):
        logits, loss = model(x, y)        # matmuls in bf16, norms and losses in float32

Autocast works as torch's does, by casts in the program: inside the region, an op of the
lower-precision list gets its floating operands (float64 aside) cast to the region's dtype, an
op of the float32 list gets them cast to float32, and every other op runs on what it is given.
The casts are ordinary ops of the table, so autograd takes each gradient back to its
operand's dtype, as torch does. The lists are torch's for the table's ops (torch's
autocast_mode.cpp, CUDA and CPU); a leaf's cast is made once per region (torch's cast cache).
linear, whose three casts (input, weight, bias) and their three gradients would be six more
instructions around each layer, casts inside its kernel instead (kw ``cast``): its gradient
kernel casts again and hands each gradient back in its operand's dtype, torch's numbers either
way.

GradScaler scales the loss, unscales the gradients in place, skips the optimizer's step when
one is not finite and adjusts the scale as torch's does (it reads one flag per step to the
host: torch decides on the GPU; the numbers are the same).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .client.dtypes import bfloat16, float16, float32
from .client.replay import as_is, capture_enabled, repeated_at
from .client.runtime import runtime
from .ops.table import OPS

# torch's autocast lists (ATen/autocast_mode.h of torch 2.13: LOWER_PRECISION_FP, FP32 and
# FP32_SET_OPT_DTYPE for CUDA; autocast_mode.cpp's CPU registrations), kept to the table's ops.
# CPU registers cross_entropy as float32.
_TORCH_LOWER = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "addmm", "matmul", "einsum", "mm", "linear",
                "baddbmm", "bmm", "scaled_dot_product_attention"}
# On CUDA torch registers no rule for cross_entropy: F.cross_entropy takes torch's composite
# there (nn/functional.py), log_softmax in the logits' dtype, then nll_loss in float32.
_TORCH_FLOAT32_CUDA = {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2",
                       "log1p", "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus",
                       "layer_norm", "rms_norm", "group_norm", "nll_loss", "kl_div", "l1_loss",
                       "smooth_l1_loss", "huber_loss", "mse_loss",
                       "binary_cross_entropy_with_logits", "logsumexp", "prod", "softmax",
                       "log_softmax", "cumprod", "cumsum", "vector_norm", "sum"}
_TORCH_FLOAT32_CPU = {"prod", "mse_loss", "nll_loss", "binary_cross_entropy",
                      "binary_cross_entropy_with_logits", "l1_loss", "smooth_l1_loss",
                      "huber_loss", "kl_div", "cross_entropy"}
LOWER = frozenset(_TORCH_LOWER & set(OPS))
FLOAT32 = {"cuda": frozenset(_TORCH_FLOAT32_CUDA & set(OPS)),
           "cpu": frozenset(_TORCH_FLOAT32_CPU & set(OPS))}
DEFAULT_DTYPE = {"cuda": float16, "cpu": bfloat16}
# lower-precision ops that cast inside their kernels
FUSED = frozenset({"linear", "linear_cross_entropy"})


class Region:
    """One active autocast region: its dtype, its lists, and the casts of leaves it made."""

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self.float32 = FLOAT32[device_type]
        self.composite_cross_entropy = device_type == "cuda"
        self.cache: dict[int, Any] = {}  # id of a leaf -> its cast (torch's cast cache)

    def fused(self, name: str, args: tuple) -> torch.dtype | None:
        """The dtype ``name`` casts its operands to inside its kernel (linear), or None."""
        if name not in FUSED:
            return None
        to = self.dtype
        return to if any(_changes(a, to) for a in args) else None

    def operands(self, name: str, args: tuple) -> tuple | None:
        """The operands of ``name`` cast as the region wants them, or None (run as given)."""
        if name in LOWER:
            to = self.dtype
        elif name in self.float32:
            to = float32
        else:
            return None
        return tuple(self._cast(a, to) for a in args)

    def _cast(self, a: Any, to: torch.dtype) -> Any:
        if not _changes(a, to):
            return a
        from .autograd import is_grad_enabled
        # torch's cache: float32 leaves that need gradients, cast down (and here only where
        # gradients are recorded, so that a cast made under no_grad is not reused with them)
        cached = to == self.dtype and a.dtype == float32 and a.requires_grad and \
            a.grad_fn is None and is_grad_enabled()
        if cached:
            hit = self.cache.get(id(a))
            if hit is not None and hit[0] is a:
                return hit[1]
        cast = a.to(to)
        if cached:
            self.cache[id(a)] = (a, cast)
        return cast


def _changes(a: Any, to: torch.dtype) -> bool:
    """Whether a region casts operand ``a`` to ``to``: a floating tensor of another dtype,
    float64 aside."""
    from .client.tensor import Tensor
    return isinstance(a, Tensor) and a.dtype.is_floating_point and \
        a.dtype not in (torch.float64, to)


class autocast:
    """torch.autocast(device_type, dtype=None, enabled=True, cache_enabled=None): a context
    manager and a decorator."""

    def __init__(self, device_type: str = "cuda", dtype: torch.dtype | None = None,
                 enabled: bool = True, cache_enabled: bool | None = None) -> None:
        device_type = str(device_type).split(":")[0]
        if device_type not in FLOAT32:
            raise RuntimeError(f"User specified an unsupported autocast device_type "
                               f"'{device_type}' (gtmpi: 'cuda' or 'cpu')")
        self.device_type = device_type
        self.dtype = dtype or DEFAULT_DTYPE[device_type]
        if self.dtype not in (bfloat16, float16):
            raise RuntimeError(f"autocast on {device_type} supports bfloat16 and float16, "
                               f"not {self.dtype}")
        self.enabled = enabled
        self._outer: list = []

    def __enter__(self) -> "autocast":
        rt = runtime()
        self._outer.append(rt.autocast)
        rt.autocast = Region(self.device_type, self.dtype) if self.enabled else None
        return self

    def __exit__(self, *exc: Any) -> None:
        runtime().autocast = self._outer.pop()

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inside(*args: Any, **kwargs: Any) -> Any:
            with autocast(self.device_type, self.dtype, self.enabled):
                return fn(*args, **kwargs)
        return inside


def is_autocast_enabled(device_type: str | None = None) -> bool:
    return runtime().autocast is not None


class GradScaler:
    """torch.amp.GradScaler(device="cuda", init_scale=2.**16, growth_factor=2.0,
    backoff_factor=0.5, growth_interval=2000, enabled=True)."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        self._enabled = enabled
        self._scale = float(init_scale)
        self._growth_factor, self._backoff_factor = growth_factor, backoff_factor
        self._growth_interval = growth_interval
        self._growth_tracker = 0
        self._found_inf: dict[int, Any] = {}  # id(optimizer) -> its flag (a gtmpi tensor)

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def scale(self, outputs: Any) -> Any:
        if not self._enabled:
            return outputs
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        return outputs * self._scale

    def unscale_(self, optimizer: Any) -> None:
        if not self._enabled:
            return
        if id(optimizer) in self._found_inf:
            raise RuntimeError("unscale_() has already been called on this optimizer since "
                               "the last update().")
        from .autograd import no_grad
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        if not grads:
            self._found_inf[id(optimizer)] = None
            return
        run = functools.partial(_unscale, grads, self._inverse())
        with no_grad():
            rt = runtime()
            if not capture_enabled(rt):
                self._found_inf[id(optimizer)] = run(as_is)
                return
            repeated = repeated_at(rt, "GradScaler.unscale_")
            # its tensors: the gradients, bound; its number: the inverse of the scale now
            self._found_inf[id(optimizer)] = repeated(
                rt, tuple(g._sig for g in grads), grads, set(), run,
                lambda source: self._inverse())

    def _inverse(self) -> float:
        """1 / scale as torch's unscale computes it (in float64, then to float32)."""
        return float(torch.tensor(self._scale, dtype=torch.float64).reciprocal().float())

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        found = self._found_inf[id(optimizer)]
        if found is not None and bool(found.item()):
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = float(new_scale)
        else:
            found = any(bool(f.item()) for f in self._found_inf.values() if f is not None)
            if found:
                self._scale *= self._backoff_factor
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    self._scale *= self._growth_factor
                    self._growth_tracker = 0
        self._found_inf.clear()

    def state_dict(self) -> dict:
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        if not self._enabled:
            return
        self._scale = float(state["scale"])
        self._growth_factor = state["growth_factor"]
        self._backoff_factor = state["backoff_factor"]
        self._growth_interval = state["growth_interval"]
        self._growth_tracker = state["_growth_tracker"]


def _unscale(grads: list, inverse: float, knob: Callable) -> Any:
    """Each gradient times ``inverse``, in place; whether any was not finite (a tensor)."""
    from .client.functions import isfinite, stack
    finite = [isfinite(g).all() for g in grads]
    inverse = knob(inverse, "inverse")
    for g in grads:
        g.mul_(inverse)
    return ~stack(finite).all()
