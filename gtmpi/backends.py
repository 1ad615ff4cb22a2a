"""torch.backends on gtmpi: the settings a training script sets first thing, applied where the
kernels run (every worker) as well as on rank 0 (ops/settings.py).

    gtmpi.backends.cuda.matmul.allow_tf32 = True
    gtmpi.backends.cudnn.allow_tf32 = True
"""
from __future__ import annotations

from typing import Any

from .client.runtime import runtime
from .ops import settings


class _Settings:
    """Attributes that read rank 0's torch and set every process's."""

    def __init__(self, prefix: str, names: tuple[str, ...]) -> None:
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_names", names)

    def __getattr__(self, name: str) -> Any:
        if name not in self._names:
            raise AttributeError(f"gtmpi.backends.{self._prefix}{name} is not a setting gtmpi "
                                 f"passes on (it passes {', '.join(self._names)})")
        return settings.current(self._prefix + name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._names:
            raise AttributeError(f"gtmpi.backends.{self._prefix}{name} is not a setting gtmpi "
                                 f"passes on (it passes {', '.join(self._names)})")
        runtime().set_backend(self._prefix + name, value)


class _Cuda:
    matmul = _Settings("cuda.matmul.", ("allow_tf32",))


cuda = _Cuda()
cudnn = _Settings("cudnn.", ("allow_tf32", "benchmark", "deterministic"))


def set_float32_matmul_precision(precision: str) -> None:
    """torch.set_float32_matmul_precision on every worker: 'highest', 'high' or 'medium'."""
    if precision not in ("highest", "high", "medium"):
        raise RuntimeError(f"Invalid precision {precision!r}: 'highest', 'high' or 'medium'")
    runtime().set_backend("float32_matmul_precision", precision)


def get_float32_matmul_precision() -> str:
    return settings.current("float32_matmul_precision")
