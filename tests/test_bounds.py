"""The index guard of a server's GPU workers (worker/bounds.py), run here on the CPU: the
indices each op row marks, checked and set in range without an error at the op, and the
client's reads failing afterwards."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gtmpi
from gtmpi.ops.table import OPS
from gtmpi.worker.bounds import IndexGuard, everywhere

X = torch.arange(60.0).reshape(3, 4, 5)


def _run(name: str, args: tuple, kw: dict | None = None):
    """(the op's result with the guard, the result without it, whether the flag rose)."""
    guard = IndexGuard(torch.device("cpu"))
    plain = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    checked = guard.check(OPS[name], list(args), kw or {})
    result = OPS[name].kernel(*checked, **(kw or {}))
    try:
        expected = OPS[name].kernel(*plain, **(kw or {}))
    except (IndexError, RuntimeError):
        expected = None
    return result, expected, guard.raised()


GOOD = [
    ("gather", (X, 2, torch.tensor([[[4, 0]] * 4] * 3))),
    ("scatter", (torch.zeros(3, 5), 1, torch.tensor([[4], [0], [2]]), torch.ones(3, 1))),
    ("scatter_add", (torch.zeros(3, 5), 1, torch.tensor([[4], [4], [2]]), torch.ones(3, 1))),
    ("index_select", (X, 1, torch.tensor([3, 0, 3]))),
    ("one_hot", (torch.tensor([0, 2, 1]), 3)),
    ("getitem", (X, torch.tensor([2, -3])), {"key": ("T",)}),
    ("getitem", (X, torch.tensor([4, -5])), {"key": (Ellipsis, "T")}),
    ("getitem", (X, torch.tensor([3])), {"key": (None, slice(None), "T")}),
    ("getitem", (X, torch.ones(3, 4, dtype=torch.bool), torch.tensor([4])),
     {"key": ("T", "T")}),
]


@pytest.mark.parametrize("setting,cuda,cpu", [(None, True, False), ("0", False, False),
                                               ("1", True, True)])
def test_gpu_workers_guard_by_default_and_the_setting_turns_it(monkeypatch, setting, cuda, cpu):
    if setting is None:
        monkeypatch.delenv("GTMPI_INDEX_GUARD", raising=False)
    else:
        monkeypatch.setenv("GTMPI_INDEX_GUARD", setting)
    assert everywhere(torch.device("cuda")) is cuda
    assert everywhere(torch.device("cpu")) is cpu
    assert everywhere(torch.device("meta")) is False  # a dry run has no values to check


@pytest.mark.parametrize("case", GOOD, ids=lambda c: c[0])
def test_indices_in_range_are_left_as_they_are(case):
    name, args, kw = (*case, None) if len(case) == 2 else case
    result, expected, raised = _run(name, args, kw)
    assert not raised
    torch.testing.assert_close(result, expected, rtol=0, atol=0)


BAD = [
    ("gather", (X, 2, torch.tensor([[[5, 0]] * 4] * 3))),
    ("scatter", (torch.zeros(3, 5), 1, torch.tensor([[5], [0], [2]]), torch.ones(3, 1))),
    ("scatter_add", (torch.zeros(3, 5), 1, torch.tensor([[-1], [4], [2]]), torch.ones(3, 1))),
    ("index_select", (X, 1, torch.tensor([3, 4]))),
    ("one_hot", (torch.tensor([0, 3, 1]), 3)),
    ("getitem", (X, torch.tensor([2, 3])), {"key": ("T",)}),
    ("getitem", (X, torch.tensor([-6])), {"key": (Ellipsis, "T")}),
    ("getitem", (X, torch.tensor([4])), {"key": (None, slice(None), "T")}),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[0])
def test_an_index_out_of_range_raises_the_flag_and_no_error(case):
    name, args, kw = (*case, None) if len(case) == 2 else case
    index = [a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.int64][0]
    result, expected, raised = _run(name, args, kw)
    assert raised and expected is None  # torch itself refuses it
    assert isinstance(result, torch.Tensor)
    _, again, raised = _run(name, args, kw)  # set in range, in place: torch takes it now
    assert again is not None and not raised
    assert int(index.min()) >= -5 and int(index.max()) < 5


def test_fused_rows_embedding_and_cross_entropy():
    weight = torch.randn(6, 3)
    for ids, bad in ((torch.tensor([[0, 5], [2, 1]]), False), (torch.tensor([[0, 6]]), True)):
        guard = IndexGuard(torch.device("cpu"))
        args = guard.check(OPS["embedding"], [ids, weight, None], {})
        out, _ = OPS["embedding"].kernel(*args)
        assert guard.raised() == bad
        if not bad:
            torch.testing.assert_close(out, F.embedding(ids, weight))
    logits = torch.randn(4, 6)
    for target, bad in ((torch.tensor([0, 5, -100, 2]), False), (torch.tensor([0, 6, 1, 2]), True)):
        guard = IndexGuard(torch.device("cpu"))
        kept = target.clone()
        args = guard.check(OPS["cross_entropy"], [logits, target, -100, "mean", 0.0], {})
        loss, _ = OPS["cross_entropy"].kernel(*args)
        assert guard.raised() == bad
        if not bad:  # ignore_index is in range
            torch.testing.assert_close(loss, F.cross_entropy(logits, kept))
    soft = torch.softmax(torch.randn(4, 6), 1)  # probabilities, not indices: not checked
    guard = IndexGuard(torch.device("cpu"))
    assert guard.check(OPS["cross_entropy"], [logits, soft, -100, "mean", 0.0], {})[1] is soft


def _local_executor():
    from gtmpi.client.runtime import runtime
    link = runtime().dispatcher.links[min(runtime().dispatcher.links)]
    return getattr(link, "executor", None)


def test_a_guarded_worker_fails_reads_after_a_bad_index_and_not_the_op():
    ex = _local_executor()
    if ex is None:
        pytest.skip("the worker runs in another process")
    emb = gtmpi.nn.Embedding(10, 4)
    good = gtmpi.tensor([1, 9, 3])
    expected = emb(good).detach().numpy()
    ex.index_guard = IndexGuard(ex.device)
    try:
        assert (emb(good).detach().numpy() == expected).all()  # in range: as without the guard
        loss = emb(gtmpi.tensor([1, 12, 3])).sum()
        line = sys._getframe().f_lineno - 1
        loss.backward()  # the gradient's scatter runs on the index set in range: no error
        # (an ordinary session's slot: the op and the line that issued it are named)
        with pytest.raises(IndexError, match=rf"op 'embedding' issued at .*test_bounds.py:{line}"
                           r".*index out of range \(checked on the device"):
            loss.item()
        with pytest.raises(gtmpi.WorkerError, match="not reliable"):
            emb(good).detach().numpy()  # the flag stays: the client's state since is not its own
    finally:
        ex.index_guard = None
        emb.weight.grad = None


def test_an_index_reused_before_its_backward_keeps_its_records():
    """A pipeline's micro-batches (or gradient accumulation) run forwards that share one
    positions tensor before the first backward: the guard's write must not make torch refuse
    the saved index (a GPU pipeline failed in embedding_grad that way)."""
    ex = _local_executor()
    if ex is None:
        pytest.skip("the worker runs in another process")
    torch.manual_seed(0)
    ids = torch.tensor([[1, 9, 3], [0, 2, 8]])
    emb = gtmpi.nn.Embedding(10, 4)
    ref = torch.nn.Embedding(10, 4)
    ref.weight.data.copy_(torch.from_numpy(emb.weight.detach().numpy()))
    ex.index_guard = IndexGuard(ex.device)
    try:
        positions = gtmpi.tensor(ids)
        losses = [(emb(positions) * k).sum() for k in (1.0, 2.0, 3.0)]  # all forwards first
        for loss in losses:
            loss.backward()
        for k in (1.0, 2.0, 3.0):
            (ref(ids) * k).sum().backward()
        np.testing.assert_allclose(emb.weight.grad.numpy(), ref.weight.grad.numpy(), rtol=1e-6)
        assert not ex.index_guard.raised()
    finally:
        ex.index_guard = None
        emb.weight.grad = None
