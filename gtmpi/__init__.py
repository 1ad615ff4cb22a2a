"""gtmpi: a single-controller tensor runtime launched by MPI.

Under ``mpiexec -n N`` / ``srun``, importing gtmpi turns ranks 1..N-1 into workers (they never
return to the user's program); rank 0 runs the program. A plain ``python`` run uses one
worker inside the process, or n spawned ones after ``gtmpi.workers(n)``.
"""
from __future__ import annotations

import builtins as _builtins
import difflib as _difflib
import sys as _sys
from typing import Any

from .transport import early as _early

_early.start()  # before torch is imported: the worker's process imports it meanwhile

import torch as _torch  # noqa: E402

from . import amp, backends, cuda, debug, nn, optim, pipeline, profiler, trace, utils
from .amp import autocast
from .backends import get_float32_matmul_precision, set_float32_matmul_precision
from . import signals as signal
from .checkpoint import load, save
from .sharded import load_sharded, save_sharded
from .autograd import (enable_grad, inference_mode, is_grad_enabled, no_grad,
                       set_grad_enabled)
from .client.creation import (arange, empty, empty_like, eye, from_numpy, full, full_like,
                              linspace, manual_seed, multinomial, ones, ones_like, rand, rand_like, randint, randperm,
                              randn, randn_like, tensor, zeros, zeros_like)
from .client.dtypes import (bfloat16, bool_, double, float16, float32, float64, half, int8,
                            int16, int32, int64, long, uint8)
from .client.functions import (addcdiv, addcmul, cdist, clamp_max, clamp_min, diag, isclose,
                               logical_xor, masked_select, meshgrid, moveaxis, movedim,
                               swapaxes, swapdims)
from .client.functions import bucketize, cummax, cummin, cumprod, searchsorted
from .client.functions import (acos, arccos, arcsin, arctan, arctan2, asin, atan, atan2,
                               digamma, hypot, lgamma, tan)
from .client.functions import (aminmax, bernoulli, broadcast_tensors, broadcast_to,
                               column_stack, cosh, count_nonzero, diagonal, diff, dot, exp2,
                               floor_divide, fmod, frac, heaviside, hstack, inner, kthvalue,
                               log2, log10, logaddexp, logit, median, nan_to_num, remainder,
                               signbit, sinh, std_mean, take_along_dim, tile, var_mean, vstack,
                               xlogy)
from .client.functions import (abs, addmm, all, allclose, any, argmax, argmin, argsort,
                               baddbmm, bmm, lerp, nonzero, outer, repeat_interleave, unique,
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
from .client.dryrun import dry_run
from .client.generator import Generator
from .client.generator import host_state as _host_state
from .client.remote import connect
from .client.replay import replayable
from .client.runtime import runtime as _runtime
from .client.tensor import Tensor
from .errors import ReplayError, Terminated, WorkerError
from .interop import torch_function as _torch_function
from .signals import ConfigError, load_config
from .launch import spawn_workers as workers
from .launch import start_role as _start_role
from .nn.capture import ask_compile as _ask_compile

bool = bool_
float, int = float32, int32  # torch.float, torch.int
device, dtype, Size = _torch.device, _torch.dtype, _torch.Size
get_default_dtype, set_default_dtype = _torch.get_default_dtype, _torch.set_default_dtype
# the host's generator, which the client's draws use (gtmpi.cuda's: the workers' stream); a
# state gtmpi.load gave back is read first
get_rng_state = _torch.get_rng_state


def set_rng_state(new_state: Any) -> None:
    _torch.set_rng_state(_host_state(new_state))
gpu_workers = workers

Tensor.__torch_function__ = _torch_function(_sys.modules[__name__], nn.functional)


def compile(model: Any = None, **options: Any) -> Any:
    """torch.compile's place. A Module is returned as it is, its calls captured as any
    module's (nn/capture.py); under GTMPI_COMPILE=asked the programs they record, forward and
    backward, are compiled by Inductor on GPU workers where that wins (auto's rule; the
    other settings decide for every program alike). A function (a training step) becomes
    gtmpi.replayable, its program asked compiled the same way. torch's options are accepted;
    the workers' compile uses none."""
    if model is None:  # @gtmpi.compile(mode=...)
        return lambda fn: compile(fn, **options)
    if isinstance(model, nn.Module):
        _ask_compile(model)
        return model
    step = replayable(model)
    step.compile = "auto"
    return step


# what a torch program may reach for that gtmpi has under another name
_INSTEAD = {"as_tensor": "gtmpi.tensor", "asarray": "gtmpi.tensor", "from_dlpack": "gtmpi.tensor",
            "jit": "gtmpi.replayable (a step recorded once, replayed by the workers)",
            "distributed": "a config's signals (gtmpi.signal, GTMPI_CONFIG): gtmpi places "
                           "tensors itself, no process group is the program's"}


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    if name in _INSTEAD:
        raise AttributeError(f"module 'gtmpi' has no attribute '{name}': use {_INSTEAD[name]}")
    near = _difflib.get_close_matches(name, [n for n in globals() if not n.startswith("_")], 3)
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    if hasattr(_torch, name):
        raise AttributeError(f"module 'gtmpi' has no attribute '{name}': torch.{name} has no "
                             f"gtmpi counterpart yet (run it on host tensors from "
                             f"t.cpu_torch()){hint}")
    raise AttributeError(f"module 'gtmpi' has no attribute '{name}'{hint}")


def synchronize() -> None:
    """Wait until every worker has executed everything issued so far."""
    _runtime().synchronize()


def info() -> dict:
    """The world: worker ranks with their hosts, process ids and devices; ``dry_run``: the
    simulated GPU's name in a dry run (values read are zeros, timings meaningless), else
    None."""
    rt = _runtime()
    return {"workers": dict(rt.workers), "world_size": len(rt.workers) + 1,
            "embedded": _builtins.any(w.get("embedded") for w in rt.workers.values()),
            "dry_run": rt.dry_run}


_start_role()
