"""torch.nn.init: in-place initialisations of parameters, with torch's formulas (fans, gains,
bounds). A tensor the client still holds (a parameter made without a device, as torch makes
it on the CPU) is initialised by torch's own function, from torch's CPU generator: torch's
numbers under torch.manual_seed. One on the workers draws from gtmpi's seeded generators: the
same on every run and every number of workers, not torch's numbers."""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from ..autograd import no_grad
from ..client import host
from ..client.runtime import runtime
from ..client.tensor import Tensor


def _torch_where_held(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """torch.nn.init's function of the same name on a tensor the client holds."""
    torch_fn = getattr(torch.nn.init, fn.__name__)

    @functools.wraps(fn)
    def init(tensor: Tensor, *args: Any, **kw: Any) -> Tensor:
        if isinstance(tensor, Tensor) and tensor._host is not None and host.allowed(runtime()):
            torch_fn(tensor._host, *args, **kw)
            tensor._recipe = None
            return tensor
        kw.pop("generator", None)
        return fn(tensor, *args, **kw)
    return init


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    linear = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
              "conv_transpose3d", "sigmoid")
    if nonlinearity in linear:
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else float(param)
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"Unsupported nonlinearity {nonlinearity}")


def _calculate_fan_in_and_fan_out(tensor: Tensor) -> tuple[int, int]:
    if tensor.ndim < 2:
        raise ValueError("Fan in and fan out can not be computed for tensor with fewer than 2 "
                         "dimensions")
    field = math.prod(tensor.shape[2:])
    return tensor.shape[1] * field, tensor.shape[0] * field


def _fan(tensor: Tensor, mode: str) -> int:
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"Mode {mode} not supported, please use one of fan_in, fan_out")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return fan_in if mode == "fan_in" else fan_out


@_torch_where_held
def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0) -> Tensor:
    with no_grad():
        return tensor.uniform_(a, b)


@_torch_where_held
def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0) -> Tensor:
    with no_grad():
        return tensor.normal_(mean, std)


@_torch_where_held
def trunc_normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0,
                  b: float = 2.0) -> Tensor:
    """torch's method: uniform between the CDFs of the bounds, through the inverse CDF."""
    def cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0
    low, high = cdf((a - mean) / std), cdf((b - mean) / std)
    with no_grad():
        tensor.uniform_(2 * low - 1, 2 * high - 1)
        tensor.copy_(tensor.erfinv() * (std * math.sqrt(2.0)) + mean)
        return tensor.clamp_(a, b)


@_torch_where_held
def constant_(tensor: Tensor, val: float) -> Tensor:
    with no_grad():
        return tensor.fill_(val)


@_torch_where_held
def ones_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 1.0)


@_torch_where_held
def zeros_(tensor: Tensor) -> Tensor:
    with no_grad():
        return tensor.zero_()


@_torch_where_held
def xavier_uniform_(tensor: Tensor, gain: float = 1.0) -> Tensor:
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(tensor, -bound, bound)


@_torch_where_held
def xavier_normal_(tensor: Tensor, gain: float = 1.0) -> Tensor:
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))


@_torch_where_held
def kaiming_uniform_(tensor: Tensor, a: float = 0.0, mode: str = "fan_in",
                     nonlinearity: str = "leaky_relu") -> Tensor:
    bound = math.sqrt(3.0) * calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode))
    return uniform_(tensor, -bound, bound)


@_torch_where_held
def kaiming_normal_(tensor: Tensor, a: float = 0.0, mode: str = "fan_in",
                    nonlinearity: str = "leaky_relu") -> Tensor:
    return normal_(tensor, 0.0, calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode)))
