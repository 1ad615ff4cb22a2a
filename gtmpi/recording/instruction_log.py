"""GT's text instruction log, kept for its users: GTMPI_INSTRUCTION_LOG=ops.log (or
GT_INSTRUCTION_LOG) writes one line per instruction the dispatcher receives and one per batch
it sends, in GT's format:

    [TAPE 0.003s] RECV | client 0 | BinaryOp | result=2 op=matmul left=0 right=1
    [TAPE 0.003s] SEND | worker 1 | Batch | seq=1 instructions=3

Tensor operands are their ids; constants are written as ``const:<value>``.
"""
from __future__ import annotations

import atexit
import time

from ..ops.table import OPS, Kind

# GT's command names, by the kind of op that carries them now.
_COMMAND = {Kind.CREATE: "CreateTensor", Kind.REDUCE: "ReduceOp", Kind.SHAPE: "ReshapeOp",
            Kind.INDEX: "IndexOp", Kind.INPLACE: "InplaceOp"}
_CONTROL = {"upload": "CreateTensor", "read": "GetData", "free": "FreeTensor"}


class InstructionLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "w", encoding="utf-8", buffering=1 << 16)
        self._start = time.perf_counter()
        atexit.register(self.close)

    def received(self, ins: tuple, rank: int) -> None:
        command, fields = describe(ins)
        self._line("RECV", "client 0", command, f"{fields} worker={rank}")

    def sent(self, batch: list, rank: int, seq: int) -> None:
        self._line("SEND", f"worker {rank}", "Batch", f"seq={seq} instructions={len(batch)}")

    def _line(self, event: str, who: str, command: str, fields: str) -> None:
        if not self._file.closed:
            self._file.write(f"[TAPE {time.perf_counter() - self._start:.3f}s] {event} | {who} | "
                             f"{command} | {fields}\n")

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def describe(ins: tuple) -> tuple[str, str]:
    """GT's command name and fields for one instruction."""
    name, out, args, tmask, kw = ins
    operands = [str(a) if tmask >> i & 1 else f"const:{a!r}" for i, a in enumerate(args)]
    result = "result=" + (",".join(map(str, out)) if isinstance(out, tuple) else str(out))
    if name == "upload":
        shape, dtype = args
        return "CreateTensor", f"{result} op=upload shape={list(shape)} dtype={dtype}"
    if name in _CONTROL:
        return _CONTROL[name], f"tensors={','.join(map(str, args))}"
    op = OPS.get(name)
    if op is None:
        return "Control", f"word={name}"
    tensors = bin(tmask).count("1")
    if op.kind in (Kind.ELEMENTWISE, Kind.MATMUL) and len(args) == 2:
        return "BinaryOp", f"{result} op={name} left={operands[0]} right={operands[1]}"
    if op.kind is Kind.ELEMENTWISE and tensors <= 1 and len(args) == 1:
        return "UnaryOp", f"{result} op={name} input={operands[0]}"
    fields = f"{result} op={name} args={' '.join(operands) or '-'}"
    if kw:
        fields += " " + " ".join(f"{k}={v!r}" for k, v in kw.items())
    return _COMMAND.get(op.kind, "Op"), fields
