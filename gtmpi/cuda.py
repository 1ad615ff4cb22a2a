"""torch.cuda's questions a program asks, answered for gtmpi's workers (the client process
itself needs no GPU)."""
from __future__ import annotations

from types import SimpleNamespace

from . import amp as _amp
from .client.runtime import runtime


def _gpus() -> list[str]:
    return [w["device"] for w in runtime().workers.values() if str(w["device"]).startswith("cuda")]


def is_available() -> bool:
    """Whether the workers have GPUs (``device = 'cuda' if torch.cuda.is_available() ...``
    then names them; where data lives is still the runtime's choice)."""
    return bool(_gpus())


def device_count() -> int:
    return len(_gpus())


def synchronize(device: object = None) -> None:
    runtime().synchronize()


def manual_seed(seed: int) -> None:
    runtime().manual_seed(seed)


manual_seed_all = manual_seed


# torch.cuda.amp's names (deprecated in torch for torch.amp, still what many scripts use)
amp = SimpleNamespace(autocast=lambda dtype=None, enabled=True, cache_enabled=None:
                      _amp.autocast("cuda", dtype, enabled, cache_enabled),
                      GradScaler=lambda *args, **kwargs: _amp.GradScaler("cuda", *args, **kwargs))
