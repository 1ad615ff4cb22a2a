"""gtmpi: a single-controller tensor runtime launched by MPI.

Under ``mpiexec -n N`` / ``srun``, importing gtmpi turns ranks 1..N-1 into workers (they never
return to the user's program); rank 0 runs the program. A plain ``python`` run uses one
worker inside the process, or n spawned ones after ``gtmpi.workers(n)``.
"""
from __future__ import annotations

from . import debug, nn, optim, pipeline, trace
from . import signals as signal
from .checkpoint import load, save
from .autograd import enable_grad, is_grad_enabled, no_grad
from .client.creation import (arange, empty, empty_like, eye, from_numpy, full, full_like,
                              manual_seed, ones, ones_like, rand, rand_like, randn, randn_like,
                              tensor, zeros, zeros_like)
from .client.dtypes import (bfloat16, bool_, double, float16, float32, float64, half, int32,
                            int64, long)
from .client.functions import (abs, argmax, argmin, cat, chunk, clamp, clip, concatenate, cos,
                               exp, flatten, gelu, log, log_softmax, matmul, max, maximum,
                               mean, min, minimum, neg, permute, relu, reshape, rsqrt, sigmoid,
                               silu, sin, softmax, split, sqrt, squeeze, stack, std, sum, tanh,
                               transpose, unsqueeze, var, where)
from .client.runtime import runtime as _runtime
from .client.tensor import Tensor
from .errors import WorkerError
from .signals import ConfigError, load_config
from .launch import spawn_workers as workers
from .launch import start_role as _start_role

bool = bool_
gpu_workers = workers


def synchronize() -> None:
    """Wait until every worker has executed everything issued so far."""
    _runtime().synchronize()


def info() -> dict:
    """The world: worker ranks with their hosts, process ids and devices."""
    rt = _runtime()
    return {"workers": dict(rt.workers), "world_size": len(rt.workers) + 1,
            "embedded": any(w.get("embedded") for w in rt.workers.values())}


_start_role()
