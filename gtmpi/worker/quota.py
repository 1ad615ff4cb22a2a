"""A server's client's quota on a worker: the bytes its tensors may hold there, checked
before each value leaves and at the end of each batch. A mixin of worker.executor.Executor."""
from __future__ import annotations

from ..errors import Fault
from ..ops.table import Graph
from .control import WAITING


class Quota:
    def _execute_within(self, batch: list[tuple], limit: int) -> None:
        """A batch of a server's client with a quota: checked before each value leaves (a
        read, a sync) and at the end, so nothing made past the quota is ever seen."""
        before = set(self.env)
        start = 0
        for i, ins in enumerate(batch):
            if ins[0] in WAITING and i > start:
                self._execute(batch[start:i])
                self._enforce_quota(limit, before)
                start = i
        self._execute(batch[start:])
        self._enforce_quota(limit, before)

    def _enforce_quota(self, limit: int, before: set[int]) -> None:
        """A server's client may hold at most ``limit`` bytes here: past it, what the last
        batch made (the ids not in ``before``) is dropped and poisoned with a MemoryError that
        its reads raise, and what the client held before stays as it was."""
        held = self._held_bytes()
        if held <= limit:
            return
        fresh = [i for i in self.env if i not in before]
        fault = Fault(fresh[0] if fresh else -1, "quota", self.rank,
                      f"MemoryError: this client's tensors on worker {self.rank} would hold "
                      f"{held / 1e9:.3f} GB, over the server's quota of {limit / 1e9:.3f} GB per "
                      "client; what the last instructions made was dropped (free tensors, or "
                      "ask for a larger quota: python -m gtmpi.server --quota-gb)")
        for i in fresh:
            self._fail(i, fault)

    def _held_bytes(self) -> int:
        """Bytes of the storages behind the tensors held here, each storage once."""
        held = []
        for t in list(self.env.values()):  # one step under the GIL: a monitor reads it too
            if isinstance(t, Graph):
                held += [t.output, *t.leaves] if t.output is not None else t.leaves
            elif t is not None:
                held.append(t)
        # meta tensors (a dry run) all have address 0: told apart by their storage object
        key = (lambda s: s._cdata) if self.device.type == "meta" else (lambda s: s.data_ptr())
        return sum({key(s): s.nbytes() for s in (t.untyped_storage() for t in held)}.values())
