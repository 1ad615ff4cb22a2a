"""Errors: shape errors at the user's line; worker failures at the next dependent read."""
from __future__ import annotations

import re

import pytest
import torch

import gtmpi
from conftest import HOME_DEVICE, assert_same


def test_shape_errors_raise_synchronously_with_torch_messages():
    a, b = gtmpi.ones(3, 4), gtmpi.ones(5, 4)
    with pytest.raises(RuntimeError, match=r"size of tensor a \(3\) must match the size of tensor b \(5\)"):
        a + b
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        a @ b
    with pytest.raises(IndexError, match="Dimension out of range"):
        a.sum(dim=5)
    with pytest.raises(RuntimeError, match="invalid for input of size 12"):
        a.reshape(5, 5)
    with pytest.raises(IndexError, match="out of bounds|out of range"):
        a[7]
    with pytest.raises(RuntimeError, match="cannot be converted to Scalar"):
        a.item()
    with pytest.raises(TypeError):
        gtmpi.zeros(2).to("not-a-dtype")


def test_shape_error_points_at_the_callers_line():
    a, b = gtmpi.ones(2), gtmpi.ones(3)
    with pytest.raises(RuntimeError) as info:
        a * b  # the failing line
    assert any(entry.path.name == "test_errors.py" for entry in info.traceback)


def test_worker_out_of_memory_raises_at_read_and_session_survives():
    huge = gtmpi.zeros(1 << 48)         # 1 PiB: a valid shape, an allocation that fails at once
                                        # (4 TiB could be overcommitted, then OOM-killed)
    line = _line_of("huge = gtmpi.zeros(1 << 48)")
    dependent = (huge + 1).sum()
    with pytest.raises(gtmpi.WorkerError) as info:
        dependent.item()
    message = str(info.value)
    assert "op 'zeros'" in message
    assert f"test_errors.py:{line}" in message
    assert re.search(r"worker rank \d+", message)
    assert "alloc" in message.lower() or "memory" in message.lower()
    assert info.value.fault.op == "zeros"
    with pytest.raises(gtmpi.WorkerError, match="op 'zeros'"):
        huge[:3].numpy()                 # a view of it is poisoned too
    ok = gtmpi.arange(4.0) * 2           # later work is unaffected
    assert ok.tolist() == [0.0, 2.0, 4.0, 6.0]


@pytest.mark.skipif(HOME_DEVICE.type == "cuda", reason="a CUDA device-side assert breaks the "
                    "worker's CUDA context for good, in gtmpi as in torch")
def test_worker_index_error_names_op_and_line():
    x = gtmpi.arange(5.0)
    bad = x[gtmpi.tensor([1, 9])]        # out of range: only the worker can tell
    line = _line_of("bad = x[gtmpi.tensor([1, 9])]")
    with pytest.raises(gtmpi.WorkerError) as info:
        print(bad)
    assert "op 'getitem'" in str(info.value) and f"test_errors.py:{line}" in str(info.value)
    assert "IndexError" in str(info.value) or "index" in str(info.value)
    assert_same(x[gtmpi.tensor([1, 4])], torch.tensor([1.0, 4.0]))


def test_faults_are_counted_in_worker_stats():
    before = sum(s["faults"] for s in gtmpi.debug.worker_stats().values())
    bad = gtmpi.zeros(1 << 48) + 1
    gtmpi.synchronize()
    after = sum(s["faults"] for s in gtmpi.debug.worker_stats().values())
    assert after == before + 2  # the failed op and the one that consumed its result
    del bad


def _line_of(text: str) -> int:
    with open(__file__) as f:
        for n, line in enumerate(f, 1):
            if text in line and "_line_of" not in line:
                return n
    raise AssertionError(text)
