"""Faults: a failed batch keeps the model, and what a fault leaves behind is reported truly."""
from __future__ import annotations

import gc
import os

import pytest
import torch

import gtmpi
import gtmpi.nn.functional as F
from conftest import HOME_DEVICE, UNDER_MPI, run_job

# On a GPU an index or label out of range is a device-side assert, which breaks the process's
# CUDA context for good, in gtmpi's worker as in torch: those cases run on CPU workers.
cpu_asserts = pytest.mark.skipif(HOME_DEVICE.type == "cuda", reason="a device-side assert on "
                                 "CUDA ends the worker's CUDA context, as it does torch's")


def _train(lib, functional, opt_cls, labels, set_to_none=True, **opt_kw):
    """Steps of a linear classifier on fixed data, one per batch of labels, some of them bad.
    Returns the weights after each step, or the name of the error it raised."""
    torch.manual_seed(0)
    w, x = torch.randn(3, 4), torch.randn(2, 4)
    m = lib.nn.Linear(4, 3, bias=False)
    with lib.no_grad():
        m.weight.copy_(lib.tensor(w) if lib is gtmpi else w)
    xs = lib.tensor(x) if lib is gtmpi else x
    opt = opt_cls(m.parameters(), lr=0.1, **opt_kw)
    seen = []
    for y in labels:
        opt.zero_grad(set_to_none=set_to_none)
        try:
            loss = functional.cross_entropy(m(xs), lib.tensor(y))
            loss.backward()
            opt.step()
            loss.item()
        except (IndexError, gtmpi.WorkerError) as e:
            seen.append(type(e).__name__)
            continue
        seen.append(m.weight.detach().numpy().copy())
    return seen


@cpu_asserts
@pytest.mark.parametrize("optimizer, kw", [("SGD", {}), ("SGD", {"momentum": 0.9}),
                                           ("AdamW", {}), ("Adam", {"weight_decay": 0.1}),
                                           ("SGD", {"momentum": 0.9, "set_to_none": False})])
def test_a_bad_batch_is_skipped_and_training_goes_on_like_torch(optimizer, kw):
    labels = [[0, 2], [0, 7], [1, 2], [2, 1]]  # 7: out of range for 3 classes
    got = _train(gtmpi, F, getattr(gtmpi.optim, optimizer), labels, **kw)
    want = _train(torch, torch.nn.functional, getattr(torch.optim, optimizer), labels, **kw)
    assert got[1] == "WorkerIndexError" and want[1] == "IndexError"  # an IndexError too
    for step in (0, 2, 3):  # Adam's bias corrections too count only the steps that ran
        torch.testing.assert_close(torch.from_numpy(got[step]), torch.from_numpy(want[step]))


def test_in_place_ops_with_a_poisoned_operand_leave_their_target():
    w = gtmpi.arange(4.0)
    bad = gtmpi.zeros(1 << 48)[:4]  # the allocation fails on the worker: poisoned
    w += bad
    w.copy_(bad)
    w[1] = bad[0]
    with pytest.raises(gtmpi.WorkerError, match=r"op 'zeros'.*in-place 'iadd'.*skipped"):
        gtmpi.synchronize()
    gtmpi.synchronize()  # reported once
    assert w.tolist() == [0.0, 1.0, 2.0, 3.0]
    stats = gtmpi.debug.worker_stats()
    assert sum(s["skipped"] for s in stats.values()) >= 3


def test_the_skipped_fault_reaches_the_next_read_of_any_tensor():
    w = gtmpi.ones(3, device="cuda")
    w *= gtmpi.zeros(1 << 48)[:3]
    with pytest.raises(gtmpi.WorkerError, match="in-place 'imul' that depended on it was skipped"):
        gtmpi.ones(2, device="cuda").tolist()
    assert w.tolist() == [1.0, 1.0, 1.0]


@cpu_asserts
def test_an_in_place_op_that_fails_itself_keeps_its_target_readable():
    w, want = gtmpi.arange(5.0, device="cuda"), torch.arange(5.0)
    w[gtmpi.tensor([1, 9])] = 7.0  # index out of range: only the worker can tell
    with pytest.raises(IndexError):
        want[torch.tensor([1, 9])] = 7.0
    with pytest.raises(gtmpi.WorkerError, match="op 'setitem'"):
        gtmpi.synchronize()
    assert w.tolist() == want.tolist()  # what torch's kernel wrote before it failed


@cpu_asserts
def test_a_model_survives_a_bad_batch_and_can_be_saved(tmp_path):
    m = gtmpi.nn.Linear(4, 3)
    opt = gtmpi.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    F.cross_entropy(m(gtmpi.randn(2, 4)), gtmpi.tensor([0, 7])).backward()
    opt.step()
    with pytest.raises(gtmpi.WorkerError, match="Target 7 is out of bounds"):
        m(gtmpi.randn(2, 4)).sum().item()
    gtmpi.save(m.state_dict(), tmp_path / "m.pt")
    assert set(torch.load(tmp_path / "m.pt")) == {"weight", "bias"}


WORKERS = sorted(gtmpi.info()["workers"])
spread = pytest.mark.skipif(len(WORKERS) < 2, reason="needs 2 or more workers (the MPI suite)")


@pytest.fixture
def halves():
    """A signal that splits dim 0 over the first two workers."""
    gtmpi.load_config({"fault_halves": {"shard": {"axis": 0, "workers": [0, 1]}}})
    return "fault_halves"


def _held(rank: int) -> int:
    return gtmpi.debug.worker_stats()[rank]["memory_bytes"]


@spread
def test_sends_between_workers_are_released(halves):
    from gtmpi.worker.dataplane import SENDS_IN_FLIGHT
    home = WORKERS[0]
    x = gtmpi.randn(256, 1024)  # 1 MB, on the home worker: each placement sends half of it
    gtmpi.signal.tensor(x, halves).sum().item()
    before = gtmpi.debug.worker_stats()[home]
    for _ in range(300):
        y = gtmpi.signal.tensor(x, halves)
        del y
    gtmpi.synchronize()
    after = gtmpi.debug.worker_stats()[home]
    assert after["sends_in_flight"] <= SENDS_IN_FLIGHT
    assert after["send_bytes_held"] <= SENDS_IN_FLIGHT * (1 << 20)
    assert after["collectives"]["send"][0] - before["collectives"]["send"][0] == 300
    assert after["rss_bytes"] - before["rss_bytes"] < 64 << 20  # leaking: 150 MB and more


@spread
def test_a_shard_holds_only_its_piece(halves):
    a, b = WORKERS[:2]
    gc.collect()  # earlier tests' graphs (reference cycles) freed now, not between the counts
    gtmpi.synchronize()
    base = {r: _held(r) for r in (a, b)}
    x = gtmpi.signal.tensor(gtmpi.randn(512, 1024), halves)  # 2 MB whole, 1 MB per piece
    gtmpi.synchronize()
    for r in (a, b):
        assert _held(r) - base[r] == 1 << 20, (r, _held(r) - base[r])
    rows = x[:2].numpy()  # gathers the whole to read two rows; the gathered copy goes
    assert rows.shape == (2, 1024)
    gtmpi.synchronize()
    for r in (a, b):
        assert _held(r) - base[r] <= (1 << 20) + 2 * 1024 * 4, (r, _held(r) - base[r])
    del x
    gtmpi.synchronize()
    assert all(_held(r) == base[r] for r in (a, b))


def test_a_split_over_one_worker_is_the_whole_tensor():
    faults = gtmpi.debug.worker_stats()[WORKERS[0]]["faults"]
    gtmpi.load_config({"fault_one": {"shard": {"axis": 0, "workers": [0]}}})
    x = gtmpi.signal.tensor(gtmpi.arange(4.0), "fault_one")
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    with gtmpi.signal.context("fault_one"):
        y = gtmpi.ones(3, 2) * 2
    assert y.sum().item() == 12.0
    assert gtmpi.debug.worker_stats()[WORKERS[0]]["faults"] == faults


def test_a_second_thread_gets_a_clear_error_and_the_first_goes_on():
    import threading
    x = gtmpi.arange(4.0)
    errors = []

    def other():
        try:
            (x + 1).tolist()
        except RuntimeError as e:
            errors.append(str(e))
    t = threading.Thread(target=other, name="helper")
    t.start()
    t.join(30)
    assert len(errors) == 1 and "thread 'helper' cannot issue ops or reads" in errors[0]
    assert (x * 2).tolist() == [0.0, 2.0, 4.0, 6.0]


def test_a_thread_may_take_over_once_the_owner_has_ended():
    import threading
    from gtmpi.client.runtime import current
    gtmpi.ones(1).tolist()
    rt = current()
    rt.thread = rt.thread_id = None  # as in a session no thread has used yet
    result = []
    helper = threading.Thread(target=lambda: result.append((gtmpi.arange(3.0) + 1).tolist()))
    helper.start()
    helper.join(30)
    assert result == [[1.0, 2.0, 3.0]] and rt.thread is helper
    assert gtmpi.ones(2).tolist() == [1.0, 1.0]  # the helper has ended: this thread takes over
    assert rt.thread is threading.current_thread()


@cpu_asserts
@spread
def test_a_bad_batch_on_one_data_parallel_worker_is_skipped_on_all(halves):
    """The bad label is in the first worker's half only: the second worker's gradients would
    be partial sums missing the first's; every replica skips the step instead, and stays equal
    to torch's run that skipped the bad batch."""
    gtmpi.load_config({"fault_replicas": {"shard": {"workers": [0, 1], "replicated": True}}})
    torch.manual_seed(0)
    w0, x = torch.randn(3, 4), torch.randn(4, 4)
    batches = [[0, 2, 1, 1], [7, 2, 1, 0], [1, 2, 0, 0]]  # 7: out of range for 3 classes
    with gtmpi.signal.context("fault_replicas"):
        w = gtmpi.tensor(w0, requires_grad=True)
    opt = gtmpi.optim.SGD([w], lr=0.1, momentum=0.9)
    want = w0.clone().requires_grad_()
    topt = torch.optim.SGD([want], lr=0.1, momentum=0.9)
    raised = []
    for labels in batches:
        opt.zero_grad()
        loss = F.cross_entropy(gtmpi.signal.tensor(x, halves) @ w.T,
                               gtmpi.signal.tensor(torch.tensor(labels), halves))
        loss.backward()
        opt.step()
        try:
            loss.item()
        except gtmpi.WorkerError as e:
            raised.append(str(e))
            continue
        topt.zero_grad()
        torch.nn.functional.cross_entropy(x @ want.T, torch.tensor(labels)).backward()
        topt.step()
    gtmpi.synchronize()  # nothing more to say: the failure was raised once
    assert len(raised) == 1 and "Target 7 is out of bounds" in raised[0]
    rows = gtmpi.signal.tensor(w.detach(), halves)  # each worker's rows from its own replica
    torch.testing.assert_close(torch.from_numpy(rows.numpy()), want.detach())
    stats = gtmpi.debug.worker_stats()
    assert stats[WORKERS[0]]["collectives"]["agree"][0] == stats[WORKERS[1]]["collectives"]["agree"][0]


@cpu_asserts
@spread
@pytest.mark.parametrize("clip", [False, True])
def test_an_optimizer_step_agrees_once_for_all_its_groups(halves, clip):
    """Two groups of parameters (AdamW's decayed matrices and undecayed biases, as a GPT's
    are), replicated on both workers: one agreement per step covers every gradient (and the
    clipping's scale, which agrees for the step that follows), and a bad batch on one worker
    still leaves both replicas as torch's run that skipped it."""
    gtmpi.load_config({"fault_groups": {"shard": {"workers": [0, 1], "replicated": True}}})
    torch.manual_seed(1)
    w0, b0, x = torch.randn(3, 4), torch.randn(3), torch.randn(4, 4)
    with gtmpi.signal.context("fault_groups"):
        w, b = gtmpi.tensor(w0, requires_grad=True), gtmpi.tensor(b0, requires_grad=True)
    opt = gtmpi.optim.AdamW([{"params": [w], "weight_decay": 0.1},
                             {"params": [b], "weight_decay": 0.0}], lr=0.1)
    tw, tb = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    topt = torch.optim.AdamW([{"params": [tw], "weight_decay": 0.1},
                              {"params": [tb], "weight_decay": 0.0}], lr=0.1)
    agreements, raised = [], []
    for labels in [[0, 2, 1, 1], [7, 2, 1, 0], [1, 2, 0, 0]]:  # 7: out of range
        opt.zero_grad()
        loss = F.cross_entropy(gtmpi.signal.tensor(x, halves) @ w.T + b,
                               gtmpi.signal.tensor(torch.tensor(labels), halves))
        loss.backward()
        gtmpi.synchronize()
        before = gtmpi.debug.worker_stats()[WORKERS[0]]["collectives"].get("agree", [0])[0]
        if clip:
            gtmpi.optim.clip_grad_norm_([w, b], 0.5)
        opt.step()
        try:  # the skipped update is said here, once
            gtmpi.synchronize()
        except gtmpi.WorkerError as e:
            raised.append(str(e))
        agreements.append(gtmpi.debug.worker_stats()[WORKERS[0]]["collectives"]["agree"][0]
                          - before)
        if labels[0] == 7:
            continue
        topt.zero_grad()
        torch.nn.functional.cross_entropy(x @ tw.T + tb, torch.tensor(labels)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([tw, tb], 0.5)
        topt.step()
    assert agreements == [1, 1, 1]
    assert len(raised) == 1 and "Target 7 is out of bounds" in raised[0]
    for got, want in ((w, tw), (b, tb)):  # each worker's rows from its own replica
        rows = gtmpi.signal.tensor(got.detach(), halves)
        torch.testing.assert_close(torch.from_numpy(rows.numpy()), want.detach())


@spread
def test_replicas_skip_an_update_together_when_one_of_them_failed():
    """The operand fails on the first worker only (an allocation too large), and reaches the
    second by a transfer, which carries zeros in its place: without agreeing first, the second
    replica would be multiplied by zeros while the first skipped the update."""
    gtmpi.load_config({"fault_first": {"shard": {"workers": [0]}},
                       "fault_both": {"shard": {"workers": [0, 1], "replicated": True}}})
    with gtmpi.signal.context("fault_both"):
        w = gtmpi.arange(4.0) + 1
    with gtmpi.signal.context("fault_first"):
        bad = gtmpi.zeros(1 << 48)[:4]
    w *= bad
    with pytest.raises(gtmpi.WorkerError, match="op 'zeros'.*skipped"):
        gtmpi.synchronize()
    gtmpi.load_config({"fault_split": {"shard": {"axis": 0, "workers": [0, 1]}}})
    rows = gtmpi.signal.tensor(w, "fault_split")  # each worker's half from its own replica
    assert rows.tolist() == [1.0, 2.0, 3.0, 4.0]


@cpu_asserts
def test_a_checkpoint_counts_the_adam_steps_the_workers_ran():
    """A skipped update is not a step: the optimizer's state_dict says how many updates each
    parameter got (as torch's run that skipped the batch), so a resume applies the bias
    corrections of the run it continues."""
    m = gtmpi.nn.Linear(4, 3)
    opt = gtmpi.optim.AdamW(m.parameters(), lr=0.1)
    for labels in ([0, 1], [0, 7], [1, 2]):  # 7: out of range, the second update is skipped
        opt.zero_grad()
        F.cross_entropy(m(gtmpi.randn(2, 4)), gtmpi.tensor(labels)).backward()
        opt.step()
        try:
            gtmpi.synchronize()
        except gtmpi.WorkerError:
            pass
    steps = [int(s["step"]) for s in opt.state_dict()["state"].values()]
    assert steps == [2, 2]
    again = gtmpi.optim.AdamW(m.parameters(), lr=0.1)
    again.load_state_dict(opt.state_dict())
    assert [int(s["step"]) for s in again.state_dict()["state"].values()] == [2, 2]


# the workers' allocator refuses one shape, as a GPU too small for a model's weight would
_NO_ROOM = """
import os, torch
if os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")) != "0":
    _empty = torch.empty
    def empty(*size, **kw):
        if size and not isinstance(size[0], int) and tuple(size[0]) == (1237, 8500):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.11 MiB")
        return _empty(*size, **kw)
    torch.empty = empty
"""


@pytest.mark.skipif(UNDER_MPI, reason="starts its own job; run from the serial suite")
def test_an_upload_with_no_room_fails_as_torchs_out_of_memory_and_the_job_goes_on(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_NO_ROOM)
    proc, _ = run_job(tmp_path, """
        import numpy as np, gtmpi
        big = gtmpi.from_numpy(np.ones((1237, 8500), dtype=np.float32))  # 42 MB: two messages
        try:
            (big * 2).sum().item()
        except gtmpi.WorkerError as e:
            print("ERROR", e)
        after = gtmpi.from_numpy(np.full((1000, 8500), 3.0, dtype=np.float32))
        print("AFTER", after.sum().item())
        """, 100, n=2, env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    error = next(line for line in proc.stdout.splitlines() if line.startswith("ERROR"))
    assert "op 'upload' issued at" in error and "prog.py:5" in error  # where it is used
    assert "OutOfMemoryError: CUDA out of memory" in error
    assert "AFTER 25500000.0" in proc.stdout  # the refused bytes were drained, not read as these
