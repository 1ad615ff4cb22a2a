"""A server's client's messages (gtmpi/transport/wire.py): every kind an instruction holds goes
and comes back as it was; anything else is refused, and nothing a message names runs."""
from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest
import torch

from conftest import UNDER_MPI
from gtmpi.ops.table import Seed
from gtmpi.transport import wire

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="no MPI in it; run once, from the serial suite")

VALUES = [None, True, False, 0, -5, 2 ** 70, -2 ** 90, 1.5, float("inf"), 2 + 3j, "héllo",
          b"\x00ab", (1, (2, [3, {4: "x", "k": None}])), slice(1, None, -2), Ellipsis,
          torch.float16, torch.strided, torch.channels_last, torch.device("cuda:1"),
          torch.Size([2, 3]), np.float64(2.5), np.int64(7), np.dtype("int32"), np.bool_(True),
          [("add", 7, (3, slice(None, 2)), 1, {"alpha": 2.0}), ("getitem", 8, (7, (Ellipsis, 1)),
                                                              1, None)]]


@pytest.mark.parametrize("value", VALUES, ids=[type(v).__name__ for v in VALUES])
def test_what_instructions_hold_comes_back_as_it_went(value):
    back = wire.loads(wire.dumps(value))
    assert back == value and type(back) is type(value)


def test_arrays_and_seeds_come_back_whole():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2]  # not contiguous
    back = wire.loads(wire.dumps(a))
    assert np.array_equal(back, a) and back.dtype == a.dtype and back.flags.writeable
    assert wire.loads(wire.dumps(np.zeros((0, 4), np.int8))).shape == (0, 4)
    seed = wire.loads(wire.dumps(Seed(12345, 3)))
    assert type(seed) is Seed and seed == 12345 and seed.offset == 3


def test_what_no_instruction_holds_is_not_sent():
    with pytest.raises(TypeError, match="carries no object"):
        wire.dumps([object()])


class _Runs:  # unpickled, it would create a file
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.mark.parametrize("data, said", [
    (b"", "it ends inside a value"),
    (b"z", "a value of kind b'z'"),
    (b"(\xff\xff\xff\xff", "a count past its end"),
    (b"a\x03\x00\x00\x00|O8(\x00\x00\x00\x00", "a numpy dtype '|O'"),
    (b"N1", "1 bytes after its value"),
    (b"d\x03\x00\x00\x00cat", "no such torch constant"),
    (b"(\x01\x00\x00\x00" * 40 + b"N", "nested deeper than 32"),
    (b"I\x41\x00\x00\x00" + bytes(65), "an int of 65 bytes"),
    (b"S\x01\x00\x00\x00f" + bytes(8), "a size of what are not ints"),
])
def test_what_is_not_a_message_is_refused_and_says_why(data, said):
    with pytest.raises(wire.Refused, match="not a message of gtmpi's") as e:
        wire.loads(data)
    assert said in str(e.value)


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    ran = tmp_path / "ran"
    with pytest.raises(wire.Refused):
        wire.loads(pickle.dumps([("add", 7, (_Runs(str(ran)),), 0, None)]))
    assert not ran.exists()


def test_random_and_mutated_bytes_are_values_or_refused():
    """20,000 messages: random bytes, and a real message with a few bytes changed. Each loads
    as a value of the kinds above or is Refused; nothing else escapes."""
    rng = random.Random(0)
    base = wire.dumps(VALUES)
    kinds = (type(None), bool, int, float, complex, str, bytes, tuple, list, dict, slice,
             type(Ellipsis), torch.dtype, torch.layout, torch.memory_format, torch.device,
             torch.Size, np.ndarray, np.generic, np.dtype, Seed)
    refused = 0
    for i in range(20_000):
        data = bytearray(base) if i % 2 else bytearray(rng.randbytes(rng.randrange(200)))
        for _ in range(rng.randrange(1, 6)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            assert isinstance(wire.loads(data), kinds)
        except wire.Refused:
            refused += 1
    assert refused > 10_000


def test_what_a_server_replies_comes_back_as_it_went():
    from gtmpi.errors import Fault
    from gtmpi.recording.events import EVENT_DTYPE
    events = np.zeros(3, EVENT_DTYPE)
    events["t0"], events["name"] = [5, 6, 7], [0, 1, -1]
    fault = Fault(12, "add", 2, "RuntimeError: shapes", "add_")
    back = wire.loads(wire.dumps({"events": events, "names": ["a", "b"], "fault": fault,
                                  "error": KeyError("k"), "graph": (None, "compiled")}))
    assert back["events"].dtype == EVENT_DTYPE and np.array_equal(back["events"], events)
    assert back["fault"] == fault and type(back["fault"]) is Fault
    assert type(back["error"]) is KeyError and back["error"].args == ("'k'",)
    assert back["graph"] == (None, "compiled")


@pytest.mark.parametrize("body", [
    b"E" + wire._U32.pack(4) + b"Exit" + wire._U32.pack(0),  # no such exception
    b"r" + wire.dumps([("o", "|O")]) + wire.dumps((1,)) + wire._U32.pack(8) + b"\0" * 8,
    b"X" + wire.dumps((1, 2, 3)),  # a fault of the wrong fields
], ids=["exception", "objects", "fault"])
def test_a_reply_of_another_kind_is_refused(body):
    with pytest.raises(wire.Refused):
        wire.loads(body)


def test_a_client_runs_nothing_its_server_sends(tmp_path):
    """Whatever answers at a port file's address: a pickle that would run code in the client
    is refused as it loads, and nothing runs."""
    from gtmpi.transport.frames import Frame
    from gtmpi.transport.remote import _Matched
    marker = tmp_path / "ran"
    bomb = pickle.dumps(_Runs(str(marker)))
    with pytest.raises(wire.Refused):
        _Matched(Frame(0, 5, bytearray(bomb))).recv()
    assert not marker.exists()
    assert _Matched(Frame(0, 5, bytearray(wire.dumps({"ok": 1})))).recv() == {"ok": 1}


class _Runs:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
