"""What a server's client and the server send each other, in a fixed binary layout that runs
nothing as it loads.

A pickle may name any function to call as it loads, and a server's workers run what its
clients wrote. So a client's messages (its batches, its rounds' counts) are not pickles but
this layout: each value a one-byte kind, then its fields (little-endian; lengths and counts
u32), nested values in turn. The kinds are the few things instructions are made of: None,
bools, ints (i64, or up to 64 bytes of two's complement), floats, complex, str, bytes, tuples,
lists, dicts, slices, Ellipsis; torch's dtypes, layouts, memory formats, devices and sizes;
numpy's arrays, scalars and dtypes (numbers and bools only); a random op's seed. ``loads`` makes
only those, refuses any other byte, an object dtype, a nesting deeper than MAX_DEPTH or a
length past the message's end, so nothing a client sends runs. A client's batch is then
checked to be instructions as gtmpi's dispatcher makes them (``check``): known op names, typed
and bounded fields. Anything else is Refused, and the server drops that client alone.

The other way, the server's replies (its workers' stats, faults, graph notes, trace parts, a
device query's answer or error) come in the same layout, with three kinds more: a Fault, an
exception of Python's own (its class's name, one of EXCEPTIONS, and its message) and a
numpy record array of numbers (a trace's events): whatever answers at a port file's address
cannot run code in its client either.

This job's own rank 0 is trusted and keeps pickle (the C pickler is the fastest encoder of
Python tuples there is).
"""
from __future__ import annotations

import struct
from typing import Any, Callable, Collection

import numpy as np
import torch

from ..errors import Fault
from ..ops.table import Knob, Seed

MAX_DEPTH = 32
BIG_INT_BYTES = 64
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
_U32 = struct.Struct("<I")
_TORCH_KINDS = {b"d": torch.dtype, b"L": torch.layout, b"M": torch.memory_format}
_NUMBERS = frozenset("biufc")  # numpy kinds a message may carry: bools and numbers


class Refused(Exception):
    """A message that is not one of gtmpi's: why, to tell its sender's server."""


# encoding (the client) ----------------------------------------------------------------------

def dumps(obj: Any) -> bytes:
    """``obj`` in the layout; TypeError for what no instruction holds."""
    out = bytearray()
    _put(obj, out)
    return bytes(out)


def _put(x: Any, out: bytearray) -> None:
    t = type(x)
    put = _PUT.get(t)
    if put is not None:
        put(x, out)
    elif isinstance(x, np.ndarray):
        _put_array(x, out)
    elif EXCEPTIONS.get(type(x).__name__) is type(x):
        out += b"E"
        _put_str(type(x).__name__, out)
        _put_str(str(x), out)
    elif isinstance(x, np.generic):
        out += b"n"
        _put_str(x.dtype.str, out)
        _put_bytes(x.tobytes(), out)
    elif isinstance(x, np.dtype):
        out += b"y"
        _put_str(x.str, out)
    else:
        raise TypeError(f"gtmpi's wire carries no {t.__name__}")


def _put_int(x: int, out: bytearray) -> None:
    if -(1 << 63) <= x < (1 << 63):
        out += b"i"
        out += _I64.pack(x)
    else:
        out += b"I"
        _put_bytes(x.to_bytes((x.bit_length() + 8) // 8, "little", signed=True), out)


def _put_str(x: str, out: bytearray) -> None:
    data = x.encode()
    out += _U32.pack(len(data))
    out += data


def _put_bytes(x: bytes, out: bytearray) -> None:
    out += _U32.pack(len(x))
    out += x


def _put_seq(kind: bytes) -> Callable[[Any, bytearray], None]:
    def put(x: Any, out: bytearray) -> None:
        out += kind
        out += _U32.pack(len(x))
        for item in x:
            _put(item, out)
    return put


def _put_dict(x: dict, out: bytearray) -> None:
    out += b"{"
    out += _U32.pack(len(x))
    for k, v in x.items():
        _put(k, out)
        _put(v, out)


def _put_array(x: np.ndarray, out: bytearray) -> None:
    if x.dtype.names:  # a record array: its fields' names and kinds
        out += b"r"
        _put([(name, x.dtype.fields[name][0].str) for name in x.dtype.names], out)
    else:
        out += b"a"
        _put_str(x.dtype.str, out)
    _put(x.shape, out)
    _put_bytes(np.ascontiguousarray(x).tobytes(), out)


def _put_seed(x: Seed, out: bytearray) -> None:
    out += b"e"
    _put_int(int(x), out)
    _put_int(x.offset, out)


def _put_knob(x: Knob, out: bytearray) -> None:
    out += b"k" + _F64.pack(x)
    _put_int(x.index, out)


def _put_fault(x: Fault, out: bytearray) -> None:
    out += b"X"
    _put(tuple(x), out)


def _put_slice(x: slice, out: bytearray) -> None:
    out += b":"
    for v in (x.start, x.stop, x.step):
        _put(v, out)


def _put_tagged(kind: bytes, text: Callable[[Any], str]) -> Callable[[Any, bytearray], None]:
    def put(x: Any, out: bytearray) -> None:
        out += kind
        _put_str(text(x), out)
    return put


_PUT: dict[type, Callable[[Any, bytearray], None]] = {
    type(None): lambda x, out: out.extend(b"N"),
    bool: lambda x, out: out.extend(b"T" if x else b"F"),
    int: _put_int,
    float: lambda x, out: out.extend(b"f" + _F64.pack(x)),
    complex: lambda x, out: out.extend(b"c" + _C128.pack(x.real, x.imag)),
    str: lambda x, out: (out.extend(b"s"), _put_str(x, out)),
    bytes: lambda x, out: (out.extend(b"b"), _put_bytes(x, out)),
    tuple: _put_seq(b"("),
    list: _put_seq(b"["),
    dict: _put_dict,
    slice: _put_slice,
    type(Ellipsis): lambda x, out: out.extend(b"."),
    Seed: _put_seed,
    Knob: _put_knob,
    Fault: _put_fault,
    torch.Size: _put_seq(b"S"),
    torch.device: _put_tagged(b"D", str),
    **{cls: _put_tagged(kind, lambda x: str(x).removeprefix("torch."))
       for kind, cls in _TORCH_KINDS.items()},
}


# Python's own exceptions a reply may carry (a device query's error), made by name
EXCEPTIONS = {cls.__name__: cls for cls in (RuntimeError, ValueError, TypeError, KeyError,
                                            IndexError, MemoryError, OSError,
                                            NotImplementedError)}


# decoding (a server's workers and its rank 0; a server's client) --------------------------

def loads(buf: bytes | bytearray | memoryview) -> Any:
    """The value laid out in ``buf``, or Refused if it is not one of gtmpi's messages (nothing
    it names is called: only the kinds above are made)."""
    reader = _Reader(bytes(buf))
    try:
        value = reader.value(0)
    except Refused:
        raise
    except Exception as e:  # a field that is not what its kind says
        raise Refused(f"not a message of gtmpi's: {type(e).__name__}: {e}"[:300]) from None
    if reader.at != len(reader.buf):
        raise Refused(f"not a message of gtmpi's: {len(reader.buf) - reader.at} bytes after "
                      "its value")
    return value


class _Reader:
    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.at = 0

    def _need(self, n: int) -> int:
        at = self.at
        if n > len(self.buf) - at:
            raise Refused("not a message of gtmpi's: it ends inside a value")
        self.at = at + n
        return at

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self._need(4))[0]

    def count(self) -> int:
        """A tuple's, list's or dict's length: each item takes a byte at least."""
        n = self.u32()
        if n > len(self.buf) - self.at:
            raise Refused("not a message of gtmpi's: a count past its end")
        return n

    def raw(self) -> bytes:
        n = self.u32()
        at = self._need(n)
        return self.buf[at:at + n]

    def text(self) -> str:
        return self.raw().decode()

    def int_(self) -> int:
        kind = self.buf[self._need(1)]
        if kind == _K_I64:
            return _I64.unpack_from(self.buf, self._need(8))[0]
        if kind == _K_BIG:
            data = self.raw()
            if len(data) > BIG_INT_BYTES:
                raise Refused(f"not a message of gtmpi's: an int of {len(data)} bytes")
            return int.from_bytes(data, "little", signed=True)
        raise Refused("not a message of gtmpi's: an int expected")

    def numeric_dtype(self) -> np.dtype:
        dtype = np.dtype(self.text())
        if dtype.kind not in _NUMBERS or dtype.hasobject:
            raise Refused(f"not a message of gtmpi's: a numpy dtype {dtype.str!r}")
        return dtype

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise Refused(f"not a message of gtmpi's: nested deeper than {MAX_DEPTH}")
        kind = self.buf[self._need(1)]
        if kind == _K_I64:
            return _I64.unpack_from(self.buf, self._need(8))[0]
        if kind == _K_TUPLE:
            return tuple([self.value(depth + 1) for _ in range(self.count())])
        if kind in _SIMPLE:
            return _SIMPLE[kind]
        if kind == _K_STR:
            return self.text()
        read = _READ.get(kind)
        if read is None:
            raise Refused(f"not a message of gtmpi's: a value of kind {bytes([kind])!r}")
        return read(self, depth + 1)

    def big(self, depth: int) -> int:
        self.at -= 1
        return self.int_()

    def list_(self, depth: int) -> list:
        return [self.value(depth) for _ in range(self.count())]

    def size(self, depth: int) -> torch.Size:
        items = self.list_(depth)
        if not all(type(i) is int for i in items):
            raise Refused("not a message of gtmpi's: a size of what are not ints")
        return torch.Size(items)

    def dict_(self, depth: int) -> dict:
        out = {}
        for _ in range(self.count()):
            key = self.value(depth)
            out[key] = self.value(depth)
        return out

    def slice_(self, depth: int) -> slice:
        return slice(self.value(depth), self.value(depth), self.value(depth))

    def constant(self, cls: type) -> Any:
        found = getattr(torch, self.text(), None)
        if type(found) is not cls:
            raise Refused("not a message of gtmpi's: no such torch constant")
        return found

    def array(self, depth: int, dtype: np.dtype | None = None) -> np.ndarray:
        dtype = dtype or self.numeric_dtype()
        shape = self.value(depth)
        if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
            raise Refused("not a message of gtmpi's: an array's shape")
        return np.frombuffer(self.raw(), dtype).reshape(shape).copy()

    def records(self, depth: int) -> np.ndarray:
        fields = self.value(depth)
        if type(fields) is not list or not all(
                type(f) is tuple and len(f) == 2 and all(type(v) is str for v in f)
                for f in fields):
            raise Refused("not a message of gtmpi's: a record array's fields")
        dtype = np.dtype([(name, kind) for name, kind in fields])
        if any(dtype.fields[name][0].kind not in _NUMBERS for name in dtype.names):
            raise Refused("not a message of gtmpi's: a record array of what are not numbers")
        return self.array(depth, dtype)

    def fault(self, depth: int) -> Fault:
        fields = self.value(depth)
        types = (int, str, int, str, str)
        if type(fields) is not tuple or len(fields) != 5 or \
                not all(type(v) is t for v, t in zip(fields, types)):
            raise Refused("not a message of gtmpi's: a fault's fields")
        return Fault(*fields)

    def exception(self, depth: int) -> Exception:
        cls = EXCEPTIONS.get(self.text())
        if cls is None:
            raise Refused("not a message of gtmpi's: an exception of no known class")
        return cls(self.text())

    def scalar(self, depth: int) -> np.generic:
        dtype = self.numeric_dtype()
        return np.frombuffer(self.raw(), dtype)[0]


def _constant(cls: type) -> Callable[[_Reader, int], Any]:
    return lambda r, depth: r.constant(cls)


_K_I64, _K_BIG, _K_TUPLE, _K_STR = b"i"[0], b"I"[0], b"("[0], b"s"[0]
_SIMPLE = {b"N"[0]: None, b"T"[0]: True, b"F"[0]: False, b"."[0]: Ellipsis}
_READ: dict[int, Callable[[_Reader, int], Any]] = {
    b"I"[0]: _Reader.big,
    b"f"[0]: lambda r, depth: _F64.unpack_from(r.buf, r._need(8))[0],
    b"c"[0]: lambda r, depth: complex(*_C128.unpack_from(r.buf, r._need(16))),
    b"b"[0]: lambda r, depth: r.raw(),
    b"["[0]: _Reader.list_,
    b"S"[0]: _Reader.size,
    b"{"[0]: _Reader.dict_,
    b":"[0]: _Reader.slice_,
    b"D"[0]: lambda r, depth: torch.device(r.text()),
    b"a"[0]: _Reader.array,
    b"r"[0]: _Reader.records,
    b"X"[0]: _Reader.fault,
    b"E"[0]: _Reader.exception,
    b"n"[0]: _Reader.scalar,
    b"y"[0]: lambda r, depth: r.numeric_dtype(),
    b"e"[0]: lambda r, depth: Seed(r.int_(), r.int_()),
    b"k"[0]: lambda r, depth: Knob(_F64.unpack_from(r.buf, r._need(8))[0], r.int_()),
    **{kind[0]: _constant(cls) for kind, cls in _TORCH_KINDS.items()},
}


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
