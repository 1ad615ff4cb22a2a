"""What a worker is sent, decoded without running anything the sender names.

Batches of instructions travel pickled (the C pickler is the fastest encoder of Python tuples
there is), but a pickle may name any function to call as it loads: a server's worker runs
batches that a client wrote, and must not run what the client chose. So every message a worker
takes from rank 0, and every round count a server takes from a client, is loaded by a strict
unpickler: it resolves only the few types instructions are made of (slices, torch's dtypes and
sizes, numpy's arrays and scalars, a random op's seed) and refuses any other name, so a
``__reduce__`` that calls ``os.system`` fails to load instead of running. A client's batch is
then checked to be instructions as gtmpi's dispatcher makes them (``check``): known op names,
typed and bounded fields. Anything else is Refused, and the server drops that client alone.
"""
from __future__ import annotations

import io
import pickle
from typing import Any, Collection

import torch

_NUMPY = ("numpy._core.numeric", "numpy.core.numeric", "numpy._core.multiarray",
          "numpy.core.multiarray")
ALLOWED = frozenset({
    ("builtins", "slice"), ("builtins", "Ellipsis"), ("builtins", "complex"),
    ("torch", "Size"), ("torch", "device"), ("gtmpi.ops.table", "Seed"), ("numpy", "dtype"),
    *((module, name) for module in _NUMPY for name in ("_frombuffer", "scalar")),
})
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class Refused(Exception):
    """A message that is not one of gtmpi's: why, to tell its sender's server."""


class _Strict(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise Refused(f"the message names {module}.{name}, which gtmpi never sends")

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("the message holds a persistent id, which gtmpi never sends")


def loads(buf: bytes | bytearray | memoryview) -> Any:
    """The object pickled in ``buf``, or Refused if it is not made of gtmpi's types (nothing
    it names beyond them is called)."""
    try:
        return _Strict(io.BytesIO(buf)).load()
    except Refused:
        raise
    except Exception as e:  # truncated, garbage, too deep: the sender is broken or hostile
        raise Refused(f"not a message of gtmpi's: {type(e).__name__}: {e}"[:300]) from None


def check(batch: Any, names: Collection[str]) -> None:
    """Raise Refused unless ``batch`` is a list of instructions (name, out, args, tmask, kw) as
    the dispatcher makes them: a name in ``names``; out an id, a tuple of ids or None; args a
    tuple whose tensor operands ``tmask`` marks (one bit per argument at most); kw a dict of
    str keys or None."""
    if type(batch) is not list:
        raise Refused(f"a batch is a list of instructions, not a {type(batch).__name__}")
    for ins in batch:
        if type(ins) is not tuple or len(ins) != 5:
            raise Refused("an instruction is a tuple (name, out, args, tmask, kw)")
        name, out, args, tmask, kw = ins
        if type(name) is not str or name not in names:
            raise Refused(f"no op or control word is named {str(name)[:40]!r}")
        if not (out is None or type(out) is int or
                (type(out) is tuple and all(o is None or type(o) is int for o in out))):
            raise Refused(f"{name}: its result ids are not ints")
        if type(args) is not tuple:
            raise Refused(f"{name}: its arguments are not a tuple")
        if type(tmask) is not int or tmask < 0 or tmask >> len(args):
            raise Refused(f"{name}: its tensor mask does not fit its {len(args)} arguments")
        if not (kw is None or (type(kw) is dict and all(type(k) is str for k in kw))):
            raise Refused(f"{name}: its keyword arguments are not a dict of names")
