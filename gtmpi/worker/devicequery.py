"""The 'device' control word: what torch.cuda answers about a worker's device, asked by a
program on rank 0 (gtmpi/cuda.py). Timing events are recorded in the worker's stream at the
point of the program where they were issued, so ``elapsed_time`` measures the device's work
between them, as torch.cuda.Event does; on a CPU worker, whose ops finish as they run, the
host clock stands in."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..transport.tags import Tag


class DeviceQueries:
    def __init__(self, device: torch.device, reply: Callable[[Tag, Any], None],
                 simulated: dict | None = None) -> None:
        self.device = device
        self.reply = reply
        self.simulated = simulated  # a dry run's properties of the GPU it stands for
        self.events: dict[int, Any] = {}

    def run(self, out: Any, args: tuple) -> None:
        """args: (action, *operands); actions that answer reply on Tag.DEVICE."""
        action, *rest = args
        getattr(self, "_" + action)(*rest)

    def _record(self, key: int) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
        else:
            event = time.perf_counter_ns()
        self.events[key] = event

    def _elapsed(self, start: int, end: int) -> None:
        a, b = self.events.get(start), self.events.get(end)
        if a is None or b is None:
            self.reply(Tag.DEVICE, RuntimeError("Both events must be recorded before "
                                                "calculating elapsed time."))
        elif self.device.type == "cuda":
            b.synchronize()
            self.reply(Tag.DEVICE, a.elapsed_time(b))
        else:
            self.reply(Tag.DEVICE, (b - a) / 1e6)

    def _query(self, key: int) -> None:
        event = self.events.get(key)
        self.reply(Tag.DEVICE, event.query() if self.device.type == "cuda" and event is not None
                   else True)

    def _forget(self, key: int) -> None:
        self.events.pop(key, None)

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _properties(self) -> None:
        if self.device.type != "cuda":
            self.reply(Tag.DEVICE, self.simulated)
            return
        p = torch.cuda.get_device_properties(self.device)
        self.reply(Tag.DEVICE, {"name": p.name, "total_memory": p.total_memory,
                                "major": p.major, "minor": p.minor,
                                "multi_processor_count": p.multi_processor_count,
                                "bf16": torch.cuda.is_bf16_supported()})
