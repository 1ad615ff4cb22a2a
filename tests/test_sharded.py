"""Sharded checkpoints (gtmpi.save_sharded / load_sharded, gtmpi/sharded.py): each worker
writes its own pieces (nothing read by rank 0), one file per worker and an index; a checkpoint
loads onto another layout and another number of workers with equal tensors, non-tensor values
(an optimizer's steps) restored; a save killed before its index leaves the last checkpoint."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import gtmpi
from conftest import mpiexec, run_job

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.gpt.model import SIZES, build  # noqa: E402

WORKERS = sorted(gtmpi.info()["workers"])
C = dataclasses.replace(SIZES["tiny"], layers=2)
serial = pytest.mark.skipif(len(WORKERS) > 1 or mpiexec() is None,
                            reason="starts its own jobs; once, serially")


def _trained(signal: str | None, seed: int = 0):
    """The tiny GPT and its AdamW after one step, where ``signal`` places them."""
    gtmpi.manual_seed(seed)
    model = build(gtmpi)(C)
    if signal is not None:
        gtmpi.signal.place(model, signal)
    opt = gtmpi.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, C.vocab, (8, C.seq + 1), generator=torch.Generator().manual_seed(seed))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    if signal is not None:
        x, y = gtmpi.signal.tensor(x, signal), gtmpi.signal.tensor(y, signal)
    model(x, y).backward()
    opt.step()
    return model, opt


def _state(model, opt) -> dict:
    return {"model": model.state_dict(), "opt": opt.state_dict()}


def _assert_equal(a: dict, b: dict) -> None:
    for (key, x), y in zip(a["model"].items(), b["model"].values()):
        assert torch.equal(x.cpu_torch(), y.cpu_torch()), key
    for i, state in a["opt"]["state"].items():
        for key, x in state.items():
            y = b["opt"]["state"][i][key]
            x, y = (v.cpu_torch() if isinstance(v, gtmpi.Tensor) else v for v in (x, y))
            assert torch.equal(torch.as_tensor(x), torch.as_tensor(y)), (i, key)


@pytest.mark.skipif(len(WORKERS) < 2, reason="needs 2 or more workers (the MPI suite)")
def test_two_workers_write_their_own_pieces_and_one_worker_loads_them(tmp_path):
    gtmpi.load_config({"sh_w": {"shard": {"workers": [0, 1], "replicated": True}, "zero": 1},
                       "sh_one": {"shard": {"workers": [1]}}})
    model, opt = _trained("sh_w")
    state = {**_state(model, opt), "epoch": 3}  # (the optimizer's step counts read here)
    sent = {r: s["bytes_sent"] for r, s in gtmpi.debug.worker_stats().items()}
    gtmpi.save_sharded(state, tmp_path)
    after = gtmpi.debug.worker_stats()
    # nothing read by rank 0 but each file's byte count (8 bytes)
    assert all(after[r]["bytes_sent"] - sent[r] <= 8 for r in sent), \
        {r: after[r]["bytes_sent"] for r in sent}
    files = sorted(os.listdir(tmp_path))
    tag = files[0].split(".")[0]
    assert files == [f"{tag}.0.rank{r}.pt" for r in WORKERS[:2]] + ["index.json"]
    # each worker wrote about half of the weights and the optimizer's moments
    sizes = [os.path.getsize(tmp_path / f) for f in files[:2]]
    assert abs(sizes[0] - sizes[1]) < 0.05 * sizes[0]
    other, other_opt = _trained("sh_one", seed=5)  # another layout: one worker, whole
    loaded = {**_state(other, other_opt), "epoch": 0}
    gtmpi.load_sharded(loaded, tmp_path)
    other_opt.load_state_dict(loaded["opt"])
    assert loaded["epoch"] == 3
    _assert_equal(_state(model, opt), _state(other, other_opt))
    assert gtmpi.debug.placement(other.tokens.weight)["mesh"] == [WORKERS[1]]


def test_a_save_cut_off_before_its_index_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    model, opt = _trained(None)
    gtmpi.save_sharded(_state(model, opt), tmp_path)
    first = {k: v.cpu_torch().clone() for k, v in model.state_dict().items()}
    index = json.loads((tmp_path / "index.json").read_text())
    before = sorted(os.listdir(tmp_path))
    with gtmpi.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    real = os.replace

    def killed(src, dst):  # the job dies as the new index would replace the old
        if str(dst).endswith("index.json"):
            raise KeyboardInterrupt
        return real(src, dst)
    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        gtmpi.save_sharded(_state(model, opt), tmp_path)
    monkeypatch.setattr(os, "replace", real)
    assert json.loads((tmp_path / "index.json").read_text()) == index
    assert set(before) <= set(os.listdir(tmp_path))  # the last save's files are all there
    gtmpi.load_sharded({"model": model.state_dict()}, tmp_path)
    for key, value in model.state_dict().items():
        assert torch.equal(value.cpu_torch(), first[key]), key
    gtmpi.save_sharded(_state(model, opt), tmp_path)  # a whole save: the old files go
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".pt")]) == len(WORKERS[:1])


def test_what_does_not_match_is_named(tmp_path):
    model, opt = _trained(None)
    gtmpi.save_sharded({"model": model.state_dict()}, tmp_path)
    with pytest.raises(KeyError, match="'/model/extra' is not in the checkpoint"):
        gtmpi.load_sharded({"model": {"extra": gtmpi.zeros(2)}}, tmp_path)
    with pytest.raises(ValueError, match=r"'/model/ln.bias' has shape \(3,\) here"):
        gtmpi.load_sharded({"model": {"ln.bias": gtmpi.zeros(3)}}, tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        gtmpi.load_sharded({}, tmp_path / "nowhere")
    with pytest.raises(TypeError, match="a sharded checkpoint holds tensors, numbers"):
        gtmpi.save_sharded({"f": len}, tmp_path)


@serial
@pytest.mark.timeout(200)
def test_four_workers_write_and_two_load_in_another_layout(tmp_path):
    """The issue's case: written by 4 workers (ZeRO-1 over all: weights cut in 4, the
    optimizer's moments in 4), loaded by a job of 2 whose weights are whole on each."""
    program = f"""
        import sys, dataclasses, torch, gtmpi
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from examples.gpt.model import SIZES, build
        c = dataclasses.replace(SIZES["tiny"], layers=2)
        n = len(gtmpi.info()["workers"])
        gtmpi.load_config({{"w": {{"shard": {{"workers": "all", "replicated": True}},
                                  "zero": 1 if n == 4 else 0}},
                           "d": {{"shard": {{"axis": 0, "workers": "all"}}}}}})
        gtmpi.manual_seed(0 if n == 4 else 9)
        model = build(gtmpi)(c)
        gtmpi.signal.place(model, "w")
        opt = gtmpi.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.randint(0, c.vocab, (8, c.seq + 1), generator=torch.Generator().manual_seed(n))
        model(gtmpi.signal.tensor(data[:, :-1], "d"), gtmpi.signal.tensor(data[:, 1:], "d")).backward()
        opt.step()
        state = {{"model": model.state_dict(), "opt": opt.state_dict()}}
        if n == 4:
            gtmpi.save_sharded(state, sys.argv[1])
        else:
            gtmpi.load_sharded(state, sys.argv[1])
            opt.load_state_dict(state["opt"])
        sums = [round(float(t.double().sum().item()), 6) for t in model.state_dict().values()]
        moments = [round(float(opt.state[p]["exp_avg_sq"].double().sum().item()), 9)
                   for p in model.parameters()]
        print("SUMS", sums, moments, opt.state_dict()["state"][0]["step"].item())
    """
    folder = str(tmp_path / "ck")
    out = []
    for n in (5, 3):
        proc, _ = run_job(tmp_path, program, 150, n=n, args=(folder,))
        assert proc.returncode == 0, proc.stderr[-3000:]
        out.append(next(line for line in proc.stdout.splitlines() if line.startswith("SUMS")))
        if n == 5:
            assert len([f for f in os.listdir(folder) if f.endswith(".pt")]) == 4
    assert out[0] == out[1]
