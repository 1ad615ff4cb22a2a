"""torch.cuda's questions a program asks, answered for gtmpi's workers (the client process
itself needs no GPU). "The current device" is the first worker's: where a program without a
config runs every op."""
from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import torch

from . import amp as _amp
from .client.runtime import runtime
from .transport.tags import Tag


def _gpus() -> list[str]:
    return [w["device"] for w in runtime().workers.values() if str(w["device"]).startswith("cuda")]


def is_available() -> bool:
    """Whether the workers have GPUs (``device = 'cuda' if torch.cuda.is_available() ...``
    then names them; where data lives is still the runtime's choice)."""
    return bool(_gpus())


def device_count() -> int:
    return len(_gpus())


def current_device() -> int:
    return 0


def set_device(device: Any) -> None:
    """Accepted: which worker runs what is the runtime's choice (signals and configs)."""
    torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _ask(action: str, *operands: Any) -> Any:
    d = runtime().dispatcher
    answer = d.ask_all("device", Tag.DEVICE, (action, *operands), [d.home])[d.home]
    if isinstance(answer, Exception):
        raise answer
    return answer


def _props() -> dict:
    """The first worker's GPU, asked once and kept with what the runtime knows of it."""
    rt = runtime()
    info = rt.workers[rt.dispatcher.home]
    if "properties" not in info:
        if not is_available():
            raise RuntimeError("Found no NVIDIA driver on your system: gtmpi's workers have no "
                               "GPU")
        info["properties"] = _ask("properties")
    return info["properties"]


def get_device_properties(device: Any = None) -> SimpleNamespace:
    p = _props()
    return SimpleNamespace(**{k: v for k, v in p.items() if k != "bf16"})


def get_device_name(device: Any = None) -> str:
    return _props()["name"]


def get_device_capability(device: Any = None) -> tuple[int, int]:
    p = _props()
    return p["major"], p["minor"]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return is_available() and bool(_props()["bf16"])


def synchronize(device: object = None) -> None:
    runtime().synchronize()


def empty_cache() -> None:
    """torch.cuda.empty_cache on every worker, after what was issued before it."""
    rt = runtime()
    rt.dispatcher.post("device", ("empty_cache",), sorted(rt.workers))


def _first_stats(reset: bool = False) -> dict:
    rt = runtime()
    return rt.worker_stats(reset)[rt.dispatcher.home]


def memory_allocated(device: Any = None) -> int:
    """Bytes of tensors held on the first worker's GPU (torch's allocator's count)."""
    return int(_first_stats().get("memory_bytes", 0))


def max_memory_allocated(device: Any = None) -> int:
    return int(_first_stats().get("peak_bytes", 0))


def memory_reserved(device: Any = None) -> int:
    return int(_first_stats().get("reserved_bytes", 0))


def max_memory_reserved(device: Any = None) -> int:
    return int(_first_stats().get("peak_reserved_bytes", 0))


def reset_peak_memory_stats(device: Any = None) -> None:
    """Every worker's peaks start afresh."""
    runtime().worker_stats(True)


reset_max_memory_allocated = reset_peak_memory_stats


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    lines = ["gtmpi workers' GPU memory (torch's allocator on each):"]
    for rank, s in sorted(runtime().worker_stats().items()):
        lines.append(f"  worker rank {rank} ({s.get('device')}): allocated "
                     f"{s.get('memory_bytes', 0) / 2**20:.1f} MiB (peak "
                     f"{s.get('peak_bytes', 0) / 2**20:.1f}), reserved "
                     f"{s.get('reserved_bytes', 0) / 2**20:.1f} MiB (peak "
                     f"{s.get('peak_reserved_bytes', 0) / 2**20:.1f})")
    return "\n".join(lines)


_events = itertools.count(1)


class Event:
    """torch.cuda.Event on the first worker's stream: ``record()`` marks the point of the
    program where it is issued, ``elapsed_time`` is the device's time between two marks."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._key: int | None = None

    def record(self, stream: Any = None) -> None:
        rt = runtime()
        if self._key is not None:
            rt.dispatcher.post("device", ("forget", self._key), [rt.dispatcher.home])
        self._key = next(_events)
        rt.dispatcher.post("device", ("record", self._key), [rt.dispatcher.home])

    def synchronize(self) -> None:
        runtime().synchronize()

    def wait(self, stream: Any = None) -> None:
        """Nothing to do: a worker runs its instructions in the order they were issued."""

    def query(self) -> bool:
        return True if self._key is None else bool(_ask("query", self._key))

    def elapsed_time(self, end: "Event") -> float:
        if not self.enable_timing or not end.enable_timing:
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._key is None or end._key is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return float(_ask("elapsed", self._key, end._key))


def manual_seed(seed: int) -> None:
    """The workers' random ops (a CUDA generator is theirs; torch's CPU one is untouched)."""
    runtime().manual_seed(seed)


manual_seed_all = manual_seed


def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    """torch.cuda.get_rng_state's use: a state that set_rng_state returns to, and the same
    draws after it. gtmpi's workers draw from one stream (each op's seed derived from the
    session seed and its position), so the state is those two numbers, the same for every
    device: a CPU int64 tensor, saved and loaded as any (a checkpoint's)."""
    return torch.tensor(runtime().rng_state(), dtype=torch.int64)


def set_rng_state(state: Any, device: Any = "cuda") -> None:
    values = state.tolist()
    if len(values) != 2:
        raise RuntimeError("gtmpi.cuda.set_rng_state: not a state gtmpi.cuda.get_rng_state made "
                           f"(2 numbers: the seed and the draws so far), got {len(values)}")
    runtime().set_rng_state(*values)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(max(device_count(), 1))]


def set_rng_state_all(states: list) -> None:
    set_rng_state(states[0])


# torch.cuda.amp's names (deprecated in torch for torch.amp, still what many scripts use)
amp = SimpleNamespace(autocast=lambda dtype=None, enabled=True, cache_enabled=None:
                      _amp.autocast("cuda", dtype, enabled, cache_enabled),
                      GradScaler=lambda *args, **kwargs: _amp.GradScaler("cuda", *args, **kwargs))
