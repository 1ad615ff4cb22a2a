"""gtmpi: a single-controller tensor runtime launched by MPI.

Under ``mpiexec -n N`` / ``srun``, importing gtmpi turns ranks 1..N-1 into workers (they never
return to the user's program); rank 0 runs the program. A plain ``python`` run uses one
worker inside the process, or n spawned ones after ``gtmpi.workers(n)``.
"""
from __future__ import annotations

import builtins as _builtins
import sys as _sys

import torch as _torch

from . import cuda, debug, nn, optim, pipeline, trace
from . import signals as signal
from .checkpoint import load, save
from .autograd import (enable_grad, inference_mode, is_grad_enabled, no_grad,
                       set_grad_enabled)
from .client.creation import (arange, empty, empty_like, eye, from_numpy, full, full_like,
                              manual_seed, multinomial, ones, ones_like, rand, rand_like, randint, randperm,
                              randn, randn_like, tensor, zeros, zeros_like)
from .client.dtypes import (bfloat16, bool_, double, float16, float32, float64, half, int8,
                            int16, int32, int64, long, uint8)
from .client.functions import (abs, addmm, all, allclose, any, argmax, argmin, baddbmm, bmm,
                               cat, ceil, chunk,
                               clamp, clip, concatenate, cos, cumsum, einsum, equal, erf, exp,
                               expm1, flatten, flip, floor, gather, gelu, index_select,
                               is_tensor, isfinite, isinf, isnan, log, log1p, log_softmax,
                               logical_and, logical_not, logical_or, logsumexp, masked_fill,
                               matmul, max, maximum, mean, min, minimum, mm, neg, norm, permute,
                               prod, reciprocal, relu, reshape, roll, round, rsqrt, sigmoid,
                               sign, silu, sin, softmax, sort, split, sqrt, square, squeeze,
                               scatter, scatter_add, stack, std, sum, tanh, topk, transpose,
                               tril, triu, trunc, unbind,
                               unsqueeze, var, where)
from .client.replay import replayable
from .client.runtime import runtime as _runtime
from .client.tensor import Tensor
from .errors import ReplayError, Terminated, WorkerError
from .interop import torch_function as _torch_function
from .signals import ConfigError, load_config
from .launch import spawn_workers as workers
from .launch import start_role as _start_role

bool = bool_
float, int = float32, int32  # torch.float, torch.int
device, dtype, Size = _torch.device, _torch.dtype, _torch.Size
get_default_dtype, set_default_dtype = _torch.get_default_dtype, _torch.set_default_dtype
gpu_workers = workers

Tensor.__torch_function__ = _torch_function(_sys.modules[__name__], nn.functional)


def synchronize() -> None:
    """Wait until every worker has executed everything issued so far."""
    _runtime().synchronize()


def info() -> dict:
    """The world: worker ranks with their hosts, process ids and devices."""
    rt = _runtime()
    return {"workers": dict(rt.workers), "world_size": len(rt.workers) + 1,
            "embedded": _builtins.any(w.get("embedded") for w in rt.workers.values())}


_start_role()
