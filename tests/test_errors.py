"""Errors: shape errors at the user's line; worker failures at the next dependent read."""
from __future__ import annotations

import re

import pytest
import torch

import gtmpi
from conftest import HOME_DEVICE, UNDER_MPI, assert_same, line_of, mpiexec, run_job


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
    with pytest.raises(RuntimeError, match="Invalid device string"):  # torch's error
        gtmpi.zeros(2).to("not-a-dtype")


def test_shape_error_points_at_the_callers_line():
    a, b = gtmpi.ones(2), gtmpi.ones(3)
    with pytest.raises(RuntimeError) as info:
        a * b  # the failing line
    assert any(entry.path.name == "test_errors.py" for entry in info.traceback)


def test_worker_out_of_memory_raises_at_read_and_session_survives():
    huge = gtmpi.zeros(1 << 48)         # 1 PiB: a valid shape, an allocation that fails at once
                                        # (4 TiB could be overcommitted, then OOM-killed)
    line = line_of(__file__, "huge = gtmpi.zeros(1 << 48)")
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
    x = gtmpi.arange(5.0, device="cuda")  # on the workers (a CPU tensor would raise here)
    bad = x[gtmpi.tensor([1, 9])]        # out of range: only the worker can tell
    line = line_of(__file__, "bad = x[gtmpi.tensor([1, 9])]")
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
    assert after == before + 1  # the failed op, not the one that read its result
    del bad


def test_worker_host_time_is_counted_per_instruction():
    """benchmarks/dispatch.py (e) divides it by the instructions run between two readings."""
    home = min(gtmpi.info()["workers"])
    before = gtmpi.debug.worker_stats()[home]
    x = gtmpi.zeros(64, 64, device="cuda")
    for _ in range(200):
        x = x + 1.0
    assert x[0, 0].item() == 200.0
    after = gtmpi.debug.worker_stats()[home]
    ops = after["ops"] - before["ops"]
    assert ops >= 200
    assert 0 < after["exec_ns"] - before["exec_ns"] < ops * 10_000_000  # under 10 ms each



def _both(lib):
    """The same wrong input, written for gtmpi and for torch (lib.nn.functional, lib.optim)."""
    F = gtmpi.nn.functional if lib is gtmpi else torch.nn.functional
    long = torch.int64
    return {
        "negative lr": lambda: lib.optim.SGD(lib.nn.Linear(2, 2).parameters(), lr=-1),
        "negative Adam lr": lambda: lib.optim.Adam(lib.nn.Linear(2, 2).parameters(), lr=-1),
        "bad beta": lambda: lib.optim.AdamW(lib.nn.Linear(2, 2).parameters(), betas=(0.9, 1.5)),
        "negative momentum": lambda: lib.optim.SGD(lib.nn.Linear(2, 2).parameters(), lr=0.1,
                                                   momentum=-0.5),
        "floats as params": lambda: lib.optim.SGD([1.0, 2.0], lr=0.1),
        "one tensor as params": lambda: lib.optim.SGD(lib.nn.Linear(2, 2).weight, lr=0.1),
        "list as state dict": lambda: lib.nn.Linear(2, 2).load_state_dict([1, 2]),
        "layer_norm of ints": lambda: F.layer_norm(lib.ones(2, 3, dtype=long), (3,)),
        "float index tensor": lambda: lib.arange(4.0)[lib.tensor([0.0, 1.0])],
        "softmax dim out of range": lambda: F.softmax(lib.ones(2, 3), dim=5),
        "log_softmax dim out of range": lambda: F.log_softmax(lib.ones(2, 3), dim=-3),
        "softmax of ints": lambda: F.softmax(lib.ones(2, 3, dtype=long), dim=1),
        "gelu of ints": lambda: F.gelu(lib.ones(2, 3, dtype=long)),
        "int @ float": lambda: lib.ones(2, 3, dtype=long) @ lib.ones(3, 2),
        "view of a transpose": lambda: lib.ones(2, 3).T.view(6),
        "view of a column slice": lambda: lib.ones(4, 4)[:, 1:].view(12),
        "integer // 0": lambda: lib.arange(4) // 0,
        "integer % 0": lambda: lib.arange(4) % 0,
    }


@pytest.mark.parametrize("case", list(_both(torch)))
def test_wrong_inputs_raise_at_the_line_as_torch(case):
    """Raised by the call itself (nothing waits for a worker), with torch's type and message."""
    with pytest.raises(Exception) as want:
        _both(torch)[case]()
    with pytest.raises(Exception) as got:
        _both(gtmpi)[case]()
    assert type(got.value) is type(want.value), (got.value, want.value)
    assert str(got.value).split("\n")[0][:60] == str(want.value).split("\n")[0][:60]
    assert gtmpi.arange(3.0).sum().item() == 3.0  # the session carries on


def test_an_index_error_on_a_worker_is_an_index_error():
    x = gtmpi.arange(5.0, device="cuda")
    with pytest.raises(IndexError, match="op 'getitem'"):
        print(x[gtmpi.tensor([1, 9])])


@pytest.mark.skipif(UNDER_MPI or mpiexec() is None, reason="starts its own job; once, serially")
def test_the_index_guard_names_the_line_and_keeps_the_worker(tmp_path):
    """GTMPI_INDEX_GUARD=1 (what a server does for its clients on GPUs, for every worker): an
    index out of range is checked on the device, set in range, and the next read raises an
    IndexError naming the op and the program's line that issued it; the worker goes on."""
    proc, _ = run_job(tmp_path, """
        import gtmpi
        emb = gtmpi.nn.Embedding(10, 4, device="cuda")
        ids = gtmpi.tensor([1, 12, 3], device="cuda")
        out = emb(ids).sum()  # line 5
        ok = gtmpi.ones(3, device="cuda") * 2
        try:
            print(out.item())
        except IndexError as e:
            print("told:", e)
        try:
            ok.sum().item()
        except IndexError as e:
            print("after:", "line 5" if "prog.py:5" in str(e) else str(e))
        print("worker", sorted(gtmpi.debug.worker_stats()))
    """, 120, env={"GTMPI_INDEX_GUARD": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    told = next(line for line in proc.stdout.splitlines() if line.startswith("told:"))
    assert "op 'embedding' issued at" in told and "prog.py:5" in told, told
    assert "index out of range (checked on the device" in told
    assert "after: line 5" in proc.stdout  # what was computed since is not reliable: said
    assert "worker [1, 2]" in proc.stdout
