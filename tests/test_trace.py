"""Traces: a known program's events on the expected ranks in the expected order, clocks
aligned, every gtmpi-trace subcommand on the file, bad files, failing runs, GT's text log."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types

import h5py
import numpy as np
import pytest
import torch

import gtmpi
from conftest import HOME_DEVICE, UNDER_MPI, is_open_mpi, launcher_env, mpiexec, run_job
from gtmpi.cli import trace_main
from gtmpi.recording import fileformat
from gtmpi.trace import analysis
from gtmpi.recording.events import EVENT_DTYPE, Flag, Kind, Lane
from gtmpi.recording.recorder import Recorder

WORKERS = sorted(gtmpi.info()["workers"])
HOME = WORKERS[0]
LIMIT_S = 90


def names(trace, table) -> list[str]:
    return [trace.name(int(n)) for n in table["name"]]


def of(table, kind: Kind, lane: Lane | None = None) -> np.ndarray:
    return analysis.select(table, (kind,), lane)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A small known program, traced: four ops, one scope, one read."""
    path = str(tmp_path_factory.mktemp("trace") / "run.h5")
    gtmpi.synchronize()
    gtmpi.trace.start(path)
    x = gtmpi.randn(8, 8, device="cuda")  # drawn by the worker (a CPU tensor stays here)
    with gtmpi.trace.scope("block"):
        y = x @ x
        z = (y + 1.0).relu()
    value = z.numpy()
    assert gtmpi.trace.stop() == path
    ids = {"x": x.id, "y": y.id, "z": z.id}
    return fileformat.read(path), ids, value


def test_program_events_on_the_expected_ranks_in_order(traced):
    trace, ids, value = traced
    assert sorted(trace.events) == [0, *WORKERS]
    zero = trace.events[0]
    issued = of(zero, Kind.ISSUE, Lane.CLIENT)
    assert names(trace, issued) == ["randn", "matmul", "add", "relu"]
    dispatched = of(zero, Kind.DISPATCH, Lane.DISPATCHER)
    assert names(trace, dispatched) == ["randn", "matmul", "add", "relu"]
    assert set(dispatched["peer"]) == {HOME}  # every tensor lives on the first worker
    assert list(issued["id"][:2]) == [ids["x"], ids["y"]] and issued["id"][3] == ids["z"]
    reads = of(zero, Kind.WAIT, Lane.CLIENT)
    assert names(trace, reads) == ["read"] and reads["id"][0] == ids["z"]
    assert reads["bytes"][0] == value.nbytes == 8 * 8 * 4

    home = trace.events[HOME]
    execs = of(home, Kind.EXEC, Lane.WORKER)
    assert names(trace, execs) == ["randn", "matmul", "add", "relu"]
    assert execs["id"][1] == ids["y"]
    sent = of(home, Kind.TRANSFER)
    assert names(trace, sent) == ["read"] and sent["id"][0] == ids["z"]
    assert sent["bytes"][0] == 256 and sent["peer"][0] == 0
    for rank in WORKERS[1:]:  # the other workers only answered the trace's control words
        table = trace.events[rank]
        assert len(of(table, Kind.EXEC)) == 0
        assert set(names(trace, of(table, Kind.CONTROL))) <= {"clock", "trace"}


def test_timestamps_monotone_and_aligned(traced):
    trace, ids, _ = traced
    for rank, table in trace.events.items():
        assert (np.diff(table["t0"]) >= 0).all(), rank
        assert (table["t1"] >= table["t0"]).all(), rank
    zero, home = trace.events[0], trace.events[HOME]
    # cause before effect across ranks: a batch is received after it was sent ...
    sends = {int(e["id"]): e for e in of(zero, Kind.SEND) if e["peer"] == HOME}
    recvs = of(home, Kind.RECV)
    assert len(recvs) and all(int(r["id"]) in sends for r in recvs)
    for r in recvs:
        assert r["t0"] >= sends[int(r["id"])]["t0"]
    # ... an op runs after the dispatcher received it, the read ends after the worker sent
    dispatched = {int(e["id"]): e for e in of(zero, Kind.DISPATCH)}
    for e in of(home, Kind.EXEC):
        assert e["t0"] >= dispatched[int(e["id"])]["t0"]
    # the read's wait (not a back-pressure wait for acks of work issued before the trace)
    read = next(e for e in of(zero, Kind.WAIT) if trace.name(int(e["name"])) == "read")
    assert read["t1"] >= of(home, Kind.TRANSFER)[0]["t0"]
    for rank in WORKERS:
        info = trace.ranks[rank]
        if not trace.meta["embedded"]:  # one host: measured offsets are within the round trip
            assert abs(info["clock_offset_start_ns"]) <= max(info["clock_rtt_start_ns"], 50_000)


def test_scope_and_metadata(traced):
    trace, _, _ = traced
    zero = trace.events[0]
    scope = of(zero, Kind.SCOPE, Lane.CLIENT)
    assert names(trace, scope) == ["block"]
    inside = of(zero, Kind.ISSUE)
    inside = inside[(inside["t0"] >= scope["t0"][0]) & (inside["t1"] <= scope["t1"][0])]
    assert names(trace, inside) == ["matmul", "add", "relu"]
    meta = trace.meta
    assert meta["status"] == "ok" and meta["world_size"] == len(WORKERS) + 1
    assert meta["versions"]["torch"] == torch.__version__ and meta["command"]
    assert re.match(r"\d{4}-\d\d-\d\dT", meta["start_time"])
    for rank, w in gtmpi.info()["workers"].items():
        assert trace.ranks[rank]["device"] == w["device"] and trace.ranks[rank]["host"] == w["host"]
        assert trace.ranks[rank]["peak_rss_bytes"] > 0
    home = trace.ranks[HOME]
    assert home["memory_bytes"] >= 0  # the traced program's tensors, where it stopped
    if HOME_DEVICE.type == "cuda":
        assert home["peak_bytes"] >= home["memory_bytes"] and home["peak_reserved_bytes"] > 0
    # readable with plain h5py, as documented
    with h5py.File(trace.path) as f:
        assert f.attrs["format"] == "gtmpi-trace"
        assert f[f"ranks/{HOME}/events"].dtype == EVENT_DTYPE
        assert "matmul" in [s.decode() for s in f["strings"][()]]


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = trace_main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _traced_loop(path: str, steps: int) -> list[dict]:
    """A small model's training loop, its loss read every step, traced: the trace's steps."""
    model = gtmpi.nn.Sequential(gtmpi.nn.Linear(8, 16), gtmpi.nn.ReLU(), gtmpi.nn.Linear(16, 1))
    opt = gtmpi.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    gtmpi.synchronize()
    gtmpi.trace.start(path)
    for _ in range(steps):
        loss = gtmpi.nn.functional.mse_loss(model(gtmpi.tensor(x)), gtmpi.tensor(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
    gtmpi.trace.stop()
    return analysis.step_rows(fileformat.read(path))


def test_steps_time_rank0_per_training_step(tmp_path, capsys, monkeypatch):
    """Steps between the optimizer's updates: as many as the loop made, less one; each issues
    the same ops; the loss read every step is rank 0's wait, the rest its host time."""
    monkeypatch.setenv("GTMPI_CAPTURE", "0")  # a captured model issues fewer after its warm-up
    path = str(tmp_path / "steps.h5")
    rows = _traced_loop(path, 6)
    assert len(rows) == 5 and {r["op"] for r in rows} == {"adam_foreach"}
    assert len({r["issued"] for r in rows}) == 1 and rows[0]["issued"] > 10
    for r in rows:
        assert r["wall_ms"] > r["host_ms"] > 0 and r["wait_ms"] > 0
        assert abs(r["host_ms"] + r["wait_ms"] - r["wall_ms"]) < 1e-6
    code, out, _ = cli(capsys, "steps", path, "--skip", "1", "--all")
    assert code == 0 and "5 steps between issues of adam_foreach; from step 1 on" in out
    assert len(out.strip().splitlines()) == 2 + 5
    code, _, err = cli(capsys, "steps", path, "--op", "conv2d")
    assert code == 2 and "no two issues of conv2d" in err


def test_a_captured_step_is_a_step_of_the_trace(tmp_path, monkeypatch):
    """With GTMPI_CAPTURE=1 the optimizer's step replays (no adam_foreach issued): its replay
    is recorded under the update's name, so every iteration is still a step."""
    monkeypatch.setenv("GTMPI_CAPTURE", "1")
    rows = _traced_loop(str(tmp_path / "captured.h5"), 8)
    assert len(rows) == 7 and {r["op"] for r in rows} == {"adam_foreach"}
    assert rows[-1]["issued"] < rows[0]["issued"]  # replayed: a few words, not every op


def test_summary_ops_idle(traced, capsys):
    trace, _, _ = traced
    code, out, _ = cli(capsys, "summary", trace.path)
    assert code == 0
    assert "busy %" in out and "top ops" in out and "waits on rank 0" in out
    busy = analysis.busy_rows(trace)
    assert {(r["rank"], r["lane"]) for r in busy} == \
        {(0, "client"), (0, "dispatcher")} | {(w, "worker") for w in WORKERS}
    for r in busy:
        assert 0 <= r["busy_pct"] <= 100 and abs(r["busy_pct"] + r["wait_pct"] + r["idle_pct"] - 100) < 1e-6 \
            or r["idle_pct"] == 0
    kinds, pairs = analysis.transfer_rows(trace)
    assert {"kind": "read", "count": 1, "bytes": 256} in kinds
    assert {"src": HOME, "dst": 0, "bytes": 256} in pairs
    assert analysis.wait_rows(trace)[0]["count"] == 1

    code, out, _ = cli(capsys, "ops", trace.path)
    assert code == 0
    rows = {r["op"]: r for r in analysis.op_rows(trace)}
    assert {op: rows[op]["count"] for op in ("randn", "matmul", "add", "relu")} == \
        dict.fromkeys(("randn", "matmul", "add", "relu"), 1)
    home = of(trace.events[HOME], Kind.EXEC)
    mm = home[np.array(names(trace, home)) == "matmul"]
    assert rows["matmul"]["total_us"] == pytest.approx((mm["t1"] - mm["t0"]).sum() / 1e3)
    assert re.search(r"^\s*matmul\s+1\s", out, re.M)

    code, out, _ = cli(capsys, "idle", trace.path, "--min-gap-us", "1")
    assert code == 0 and "no pipeline in this run" in out
    assert analysis.bubble_rows(trace) == []  # no pipeline ran: no stages, no bubbles
    assert "gpu timed" not in cli(capsys, "ops", trace.path)[1] or HOME_DEVICE.type == "cuda"


def test_timeline_picture_has_a_lane_per_rank(traced, tmp_path, capsys):
    trace, _, _ = traced
    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    code, out, _ = cli(capsys, "timeline", trace.path, "-o", str(png))
    assert code == 0 and f"{len(WORKERS) + 2} lanes" in out
    import matplotlib.image
    image = matplotlib.image.imread(str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.shape[0] > 100
    code, _, _ = cli(capsys, "timeline", trace.path, "-o", str(svg), "--ranks", f"0,{HOME}",
                     "--ops", "matmul", "--start", "0", "--end", "1e6")
    assert code == 0
    text = svg.read_text()
    assert "rank 0 client" in text and "rank 0 dispatcher" in text and f"rank {HOME} worker" in text
    for other in WORKERS[1:]:
        assert f"rank {other} worker" not in text


def test_export_is_chrome_json_with_every_event(traced, tmp_path, capsys):
    trace, _, _ = traced
    out_json = tmp_path / "run.json"
    code, _, _ = cli(capsys, "export", trace.path, "-o", str(out_json))
    assert code == 0
    doc = json.loads(out_json.read_text())
    events = doc["traceEvents"]
    complete = [e for e in events if e["ph"] == "X" and e["cat"] != "gpu"]
    assert len(complete) == sum(len(t) for t in trace.events.values())
    assert {e["pid"] for e in complete} == {0, *WORKERS}
    flows = [e for e in events if e["ph"] in "sf"]
    assert flows and len([e for e in flows if e["ph"] == "s"]) == len([e for e in flows if e["ph"] == "f"])
    assert any(e["name"] == "matmul" and e["pid"] == HOME for e in complete)


@pytest.mark.parametrize("content", ["missing", "truncated", "foreign_h5", "text"])
def test_bad_files_get_one_line_and_status_2(traced, tmp_path, capsys, content):
    trace, _, _ = traced
    path = tmp_path / "bad.h5"
    if content == "truncated":
        path.write_bytes(open(trace.path, "rb").read()[:2000])
    elif content == "foreign_h5":
        with h5py.File(path, "w") as f:
            f["x"] = np.arange(3)
    elif content == "text":
        path.write_text("not a trace\n")
    for command in ("summary", "ops", "idle", "timeline", "export"):
        extra = ["-o", str(tmp_path / "o.png")] if command in ("timeline", "export") else []
        code, out, err = cli(capsys, command, str(path), *extra)
        assert code == 2, (command, out, err)
        assert err.count("\n") == 1 and err.startswith("gtmpi-trace: error: ") and \
            "Traceback" not in err, err


def test_help_on_every_subcommand(capsys):
    for command in ("summary", "ops", "idle", "timeline", "export"):
        with pytest.raises(SystemExit) as stop:
            trace_main([command, "--help"])
        assert stop.value.code == 0
        assert f"usage: gtmpi-trace {command}" in capsys.readouterr().out
    code, _, err = cli(capsys, "timeline", "x.h5", "-o", "x.gif")
    assert code == 2 and err.count("\n") == 1


def test_start_twice_and_stop_without_trace(tmp_path):
    with pytest.raises(RuntimeError, match="no trace is recording"):
        gtmpi.trace.stop()
    gtmpi.trace.start(str(tmp_path / "a.h5"))
    try:
        with pytest.raises(RuntimeError, match="already recording"):
            gtmpi.trace.start(str(tmp_path / "b.h5"))
    finally:
        gtmpi.trace.stop()
    assert not gtmpi.trace.active()


def test_faults_are_marked(tmp_path):
    path = str(tmp_path / "fault.h5")
    gtmpi.trace.start(path)
    try:
        bad = gtmpi.zeros(1 << 48)
        with pytest.raises(gtmpi.WorkerError):
            (bad + 1).sum().item()
        gtmpi.ones(2, device="cuda").sum().item()
    finally:
        gtmpi.trace.stop()
    trace = fileformat.read(path)
    execs = of(trace.events[HOME], Kind.EXEC)
    faulted = execs[(execs["flags"] & Flag.FAULT) != 0]
    assert names(trace, faulted) == ["zeros", "add", "sum"]  # the failure and its consumers
    assert names(trace, execs[(execs["flags"] & Flag.FAULT) == 0]) == ["ones", "sum"]
    assert "zeros" in trace.name(int(faulted["detail"][0]))


@pytest.mark.skipif(HOME_DEVICE.type != "cuda", reason="CUDA events need a GPU worker")
def test_gpu_ops_timed_with_cuda_events(tmp_path):
    path = str(tmp_path / "gpu.h5")
    gtmpi.trace.start(path, gpu_every=1)
    a = gtmpi.randn(1024, 1024, device="cuda")
    for _ in range(4):
        a = a @ a / 1024
    a.sum().item()
    gtmpi.trace.stop()
    trace = fileformat.read(path)
    execs = of(trace.events[HOME], Kind.EXEC)
    timed = execs[(execs["flags"] & Flag.GPU_TIMED) != 0]
    assert len(timed) == len(execs)
    assert (timed["gpu_t1"] > timed["gpu_t0"]).all()
    # GPU time on the host clock: a kernel starts after its launch began
    assert (timed["gpu_t0"] >= timed["t0"] - 1_000_000).all()
    assert analysis.op_rows(trace)[0]["gpu_timed"] > 0


def test_snapshots_while_running_lose_and_repeat_nothing(tmp_path, monkeypatch):
    """Parts sent mid-batch and mid-run join into exactly the program's events."""
    import time
    from gtmpi.client.runtime import runtime
    monkeypatch.setenv("GTMPI_TRACE_SNAPSHOT_S", "0.005")
    path = str(tmp_path / "parts.h5")
    # each op as written: a replayed run's ops carry its program's ids, not the client's
    auto = runtime().dispatcher.repeats is not None
    gtmpi.debug.auto_replay(False)
    try:
        gtmpi.trace.start(path)
        x = gtmpi.ones(4, 4, device="cuda")
        ids = []
        for i in range(200):
            x = x * 0.5 + 1.0
            ids += [x.id]
            if i % 20 == 0:
                time.sleep(0.01)
                x.sum().item()
        gtmpi.trace.stop()
    finally:
        gtmpi.debug.auto_replay(auto)
    trace = fileformat.read(path)
    execs = of(trace.events[HOME], Kind.EXEC)
    adds = execs[np.array(names(trace, execs)) == "add"]
    assert list(adds["id"]) == ids
    assert names(trace, of(trace.events[HOME], Kind.CONTROL)).count("trace") >= 2  # a part, then the rest
    assert (np.diff(trace.events[HOME]["t0"]) >= 0).all()


def test_recorder_chunks_pack_like_one_list(monkeypatch):
    from gtmpi.recording import recorder
    monkeypatch.setattr(recorder, "CHUNK", 4)
    whole, chunked = Recorder(1), Recorder(1)
    t = 1000
    for rec, compact in ((whole, False), (chunked, True)):
        t = 1000
        for batch in range(3):
            for i in range(3):
                rec.marks.append((t, "add", batch * 10 + i))
                t += 10
            rec.marks.append((t, None, None))
            t += 100
            if compact:
                rec.compact()
        rec.issues.append((1, 2, 3, "add", (7, 8), 1))
    a, b = whole.pack(), chunked.pack()
    assert chunked._marks_before > 0
    assert a["events"].tobytes() == b["events"].tobytes() and a["names"] == b["names"]
    spans = a["events"][a["events"]["kind"] == Kind.EXEC]
    assert list(spans["id"]) == [0, 1, 2, 10, 11, 12, 20, 21, 22]
    assert set(spans["t1"] - spans["t0"]) == {10}  # each op ends where the next one starts


def test_union_of_intervals():
    t0, t1 = np.array([0, 5, 20, 22, 40]), np.array([10, 8, 30, 25, 40])
    assert analysis.union_ns(t0, t1) == 10 + 10 + 0
    assert analysis.union_ns(np.zeros(0, np.int64), np.zeros(0, np.int64)) == 0


# Whole runs as a user starts them ---------------------------------------------------------

job = pytest.mark.skipif(UNDER_MPI or mpiexec() is None,
                         reason="starts its own jobs; run once, from the serial suite")

PROGRAM = """
    import sys, gtmpi
    x = gtmpi.randn(16, 16, device="cuda")
    for _ in range(10):
        x = (x @ x).tanh()
    print("SUM", x.sum().item(), flush=True)
    if sys.argv[1:] == ["raise"]:
        raise ValueError("half-way")
    if sys.argv[1:] == ["worker"]:
        gtmpi.zeros(1 << 48).sum().item()
    if sys.argv[1:] == ["idle"]:  # a worker dies while rank 0 is in its own code
        import os, signal, time
        time.sleep(0.3)
        os.kill(gtmpi.info()["workers"][2]["pid"], signal.SIGKILL)
        time.sleep(30)
    if sys.argv[1:] == ["kill"]:  # the launcher then kills every rank: no chance to write
        import os, signal, time
        start = time.monotonic()
        while time.monotonic() - start < 1.0:
            x = (x @ x).tanh()
            x.sum().item()
        os.kill(gtmpi.info()["workers"][2]["pid"], signal.SIGKILL)
        time.sleep(30)
    print("DONE", (x + 1).mean().item())
"""


@job
def test_env_trace_of_an_mpi_job_with_shifted_worker_clocks(tmp_path):
    """Workers' clocks 5 s ahead, as on other hosts: offsets are measured, events line up."""
    path = tmp_path / "run.h5"
    shift = "5000000000"
    if is_open_mpi(mpiexec()):
        split = ["-n", "1", sys.executable, str(tmp_path / "prog.py"), ":",
                 "-n", "2", "-x", f"GTMPI_TRACE_CLOCK_SHIFT_NS={shift}"]
    else:
        split = ["-n", "1", sys.executable, str(tmp_path / "prog.py"), ":",
                 "-n", "2", "-env", "GTMPI_TRACE_CLOCK_SHIFT_NS", shift]
    proc, _ = run_job(tmp_path, PROGRAM, LIMIT_S, n=None, env={"GTMPI_TRACE": str(path)})
    assert proc.returncode == 0, proc.stderr  # plain python: the embedded worker, traced
    plain = fileformat.read(str(path))
    assert plain.meta["embedded"] and plain.meta["world_size"] == 2
    env = {**os.environ, **launcher_env(), "GTMPI_DEVICE": "cpu", "GTMPI_TRACE": str(path)}
    proc = subprocess.run([mpiexec(), *split, sys.executable, str(tmp_path / "prog.py")],
                          capture_output=True, text=True, timeout=LIMIT_S, env=env,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    trace = fileformat.read(str(path))
    assert trace.meta["status"] == "ok" and sorted(trace.events) == [0, 1, 2]
    for rank in (1, 2):
        for when in ("start", "end"):
            offset = trace.ranks[rank][f"clock_offset_{when}_ns"]
            assert abs(offset - int(shift)) < 1_000_000, (rank, when, offset)
    zero, home = trace.events[0], trace.events[1]
    sends = {int(e["id"]): int(e["t0"]) for e in of(zero, Kind.SEND) if e["peer"] == 1}
    for r in of(home, Kind.RECV):
        assert r["t0"] >= sends[int(r["id"])] - 100_000  # aligned to well within 0.1 ms
    assert abs(int(home["t0"].min())) < 1e9  # shifted by 5 s before alignment
    assert names(trace, of(home, Kind.EXEC)).count("matmul") == 10
    assert [trace.name(int(e["name"])) for e in of(zero, Kind.WAIT)] == ["read", "read"]


@job
@pytest.mark.parametrize("how", ["raise", "worker"])
def test_a_run_failing_half_way_leaves_a_readable_file(tmp_path, capsys, how):
    path = tmp_path / "failed.h5"
    proc, _ = run_job(tmp_path, PROGRAM, LIMIT_S, args=(how,), env={"GTMPI_TRACE": str(path)})
    assert proc.returncode != 0 and "SUM" in proc.stdout and "DONE" not in proc.stdout
    assert f"trace of the failed run written to {path}" in proc.stderr
    trace = fileformat.read(str(path))
    want = "ValueError: half-way" if how == "raise" else "WorkerError: op 'zeros'"
    assert trace.meta["status"].startswith(f"failed: {want}")
    execs = names(trace, of(trace.events[1], Kind.EXEC))
    assert execs.count("matmul") == 10  # the events up to the failure
    assert cli(capsys, "summary", str(path))[0] == 0


@job
def test_a_killed_run_leaves_its_last_snapshot(tmp_path, capsys):
    path = tmp_path / "killed.h5"
    proc, _ = run_job(tmp_path, PROGRAM, LIMIT_S, args=("kill",),
                      env={"GTMPI_TRACE": str(path), "GTMPI_TRACE_SNAPSHOT_S": "0.1"})
    assert proc.returncode != 0 and "DONE" not in proc.stdout
    trace = fileformat.read(str(path))
    assert trace.meta["status"] == "running: snapshot"
    execs = names(trace, of(trace.events[1], Kind.EXEC))
    assert execs.count("matmul") > 10 and execs.count("tanh") > 10  # from the timed loop
    assert cli(capsys, "summary", str(path))[0] == 0


@job
def test_a_run_killed_while_rank0_was_idle_leaves_a_file(tmp_path, capsys):
    path = tmp_path / "idle.h5"
    proc, _ = run_job(tmp_path, PROGRAM, LIMIT_S, args=("idle",), env={"GTMPI_TRACE": str(path)})
    assert proc.returncode != 0 and "SUM" in proc.stdout and "DONE" not in proc.stdout
    trace = fileformat.read(str(path))  # written when the trace started, at the latest
    assert trace.meta["status"].startswith("running")
    assert cli(capsys, "summary", str(path))[0] == 0


@job
def test_snapshots_while_uploads_stream_over_the_embedded_workers_pipe(tmp_path, capsys):
    """The worker process of plain `python` on a GPU, here on the CPU: rank 0 writing an upload
    larger than the socket pair holds while the worker writes a snapshot larger than it holds.
    Both blocked in write() for good (nanoGPT's get_batch, traced, hung that way)."""
    path = tmp_path / "run.h5"
    proc, _ = run_job(tmp_path, """
        import time, numpy as np, gtmpi
        host = np.ones(80_000, np.float32)  # 320 KB a time, over the socket pair's 200 KB
        y = gtmpi.tensor(host) * 2
        start, steps = time.monotonic(), 0
        while time.monotonic() - start < 2.5:  # snapshots of thousands of events fall due
            y = gtmpi.tensor(host) * 2
            steps += 1
        print("DONE", steps, y.sum().item(), flush=True)
    """, 60, n=None, env={"GTMPI_EMBEDDED_PROCESS": "1", "GTMPI_TRACE": str(path),
                          "GTMPI_TRACE_SNAPSHOT_S": "0.5", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    done = proc.stdout.split()
    assert done[0] == "DONE" and float(done[2]) == 160_000.0
    trace = fileformat.read(str(path))
    assert trace.meta["status"] == "ok" and not trace.meta["missing_ranks"]
    uploads = of(trace.events[1], Kind.TRANSFER)
    assert names(trace, uploads).count("upload") >= int(done[1]) + 1  # the worker took all
    assert cli(capsys, "summary", str(path))[0] == 0


@job
def test_gt_instruction_log(tmp_path):
    log = tmp_path / "ops.log"
    proc, _ = run_job(tmp_path, """
        import gtmpi
        a = gtmpi.ones(2, 2, device="cuda")
        b = a @ a
        print(b.neg().sum().item())
    """, LIMIT_S, n=None, env={"GT_INSTRUCTION_LOG": str(log)})
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().splitlines()
    line = re.compile(r"^\[TAPE \d+\.\d{3}s\] (RECV|SEND) \| (client 0|worker 1) \| \w+ \| .+$")
    assert lines and all(line.match(l) for l in lines), lines
    recv = [l.split(" | ", 2)[2] for l in lines if " RECV " in l]
    assert recv[:4] == ["CreateTensor | result=1 op=ones args=const:(2, 2) const:torch.float32 worker=1",
                        "BinaryOp | result=2 op=matmul left=1 right=1 worker=1",
                        "UnaryOp | result=3 op=neg input=2 worker=1",
                        "ReduceOp | result=4 op=sum args=3 const:None const:False worker=1"]
    assert "GetData | tensors=4 worker=1" in recv
    assert any(" SEND | worker 1 | Batch | seq=" in l for l in lines)


@pytest.mark.skipif(len(WORKERS) < 2, reason="needs 2 or more workers (the MPI suite)")
def test_idle_reports_a_pipelines_stages_against_the_schedules_bubble(tmp_path, capsys):
    from gtmpi.pipeline import Pipeline
    gtmpi.load_config({"front": {"shard": {"workers": [0]}}, "back": {"shard": {"workers": [1]}}})
    w1 = gtmpi.signal.tensor(torch.randn(16, 16), "front").requires_grad_()
    w2 = gtmpi.signal.tensor(torch.randn(16, 1), "back").requires_grad_()
    pipe = Pipeline([lambda x: (x @ w1).relu(), lambda h, y: ((h @ w2 - y) ** 2).mean()],
                    ["front", "back"], micro_batches=4)
    path = str(tmp_path / "pipe.h5")
    gtmpi.synchronize()
    gtmpi.trace.start(path)
    pipe.step(torch.randn(8, 16), torch.randn(8, 1)).item()
    gtmpi.trace.stop()
    trace = fileformat.read(path)
    rows = analysis.bubble_rows(trace)
    assert [r["ranks"] for r in rows] == [[WORKERS[0]], [WORKERS[1]]]
    assert all(r["ideal"] == pytest.approx(1 / 5) and 0 <= r["bubble"] < 1 for r in rows)
    # each stage's share of the compute, and how far from the mean: the shares make the whole
    assert sum(r["share"] for r in rows) == pytest.approx(1)
    assert sum(r["over"] for r in rows) == pytest.approx(0, abs=1e-9)
    code, out, _ = cli(capsys, "idle", path)
    assert code == 0 and "2 stages, 4 micro-batches, 1f1b" in out
    assert re.search(r"^\s*0\s+%d\s+0\.\d{3}\s+0\.200\s+0\.\d{3}\s+[+-]\d\.\d{3}$" % WORKERS[0],
                     out, re.M), out


def test_kernel_profile_splits_a_step_into_compute_nccl_and_idle(tmp_path, capsys):
    """gtmpi.trace.kernels on a worker's CUPTI profile (worker/profiler.py writes it on GPUs):
    two steps of a matmul, an all-reduce overlapping its end, a lone send and a gap."""
    from gtmpi.trace import kernels

    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = []
    for base in (0, 1000):  # two steps of 1000 µs each: the window is 2000 µs long
        events += [kernel("void cutlass::Kernel2<sm90_gemm_bf16>(Params)", base, 500),
                   kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgs)",
                          base + 400, 200),  # 100 µs of it alone
                   kernel("ncclDevKernel_SendRecv(ncclDevKernelArgs)", base + 700, 100),
                   kernel("void at::native::vectorized_elementwise_kernel<4>(int)", base + 850,
                          150)]
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0,
                   "dur": 5000})  # host events are not kernels
    (tmp_path / "worker1.json").write_text(json.dumps({"traceEvents": events}))
    assert kernels.main([str(tmp_path), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    line = json.loads(out.strip().splitlines()[-1])["worker1"]
    assert line == {"step_ms": 1.0, "compute_ms": 0.65, "nccl_only_ms": 0.2, "idle_ms": 0.15,
                    "nccl_ms": 0.3, "shared": {"compute": 0.65, "nccl_only": 0.2, "idle": 0.15}}
    # a second worker that started recording 500 µs later: the shared window is 500-2000 µs,
    # the second half of worker 1's first step and all its second; worker 2's first step and
    # the first half of its second (its matmul)
    late = [{**e, "ts": e["ts"] + 500} for e in events if e["cat"] == "kernel"]
    (tmp_path / "worker2.json").write_text(json.dumps({"traceEvents": late}))
    assert kernels.main([str(tmp_path), "--steps", "2"]) == 0
    lines = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert lines["worker1"]["shared"] == {"compute": 0.5333, "nccl_only": 0.2667, "idle": 0.2}
    assert lines["worker2"]["shared"] == {"compute": 0.7667, "nccl_only": 0.1333, "idle": 0.1}
    assert "nccl AllReduce" in out and "nccl SendRecv" in out and "Kernel2" in out
    # worker 1's gaps: 100 µs after each all-reduce (600-700, 1600-1700) and 50 µs after each
    # send (800-850, 1800-1850); the elementwise kernel ends its first step at 1000, where the
    # next step's matmul starts at once
    found = kernels.gaps(kernels.load(str(tmp_path / "worker1.json")), 3)
    assert [round(g[0]) for g in found] == [100, 100, 50]
    assert {(g[1], g[2]) for g in found} == {("nccl AllReduce", "nccl SendRecv"),
                                            ("nccl SendRecv", "vectorized_elementwise_kernel")}
    assert kernels.main([str(tmp_path), "--steps", "2", "--gaps", "2"]) == 0
    assert "longest idle gaps" in capsys.readouterr().out


def test_kernel_profile_window_is_whole_optimizer_steps(tmp_path, monkeypatch):
    """A worker's kernel profile (worker/profiler.py) opens at the FIRST-th optimizer step and
    closes at the (FIRST+COUNT)-th, however many programs a step runs and however many
    parameter groups its step updates (two adam_foreach in a row are one step); torch's own
    runs in benchmarks/real.py count the same steps."""
    from gtmpi.worker import profiler as prof

    events = []

    class Recording:
        def __enter__(self):
            events.append(("open", len(seen)))

        def __exit__(self, *exc):
            events.append(("close", len(seen)))

        def export_chrome_trace(self, path):
            open(path, "w").write("{}")

    monkeypatch.setattr(prof.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(prof.torch.profiler, "profile", lambda **kw: Recording())
    monkeypatch.setattr(prof.torch.profiler._utils, "_init_for_cuda_graphs", lambda: None)
    p = prof.KernelProfiler(1, str(tmp_path), first=2, count=2)
    seen = []
    forward = [("replay", 0, (), 0, None)]
    program = [("linear", 5, (1, 2), 3, None), ("add", 6, (5, 1), 1, None)]
    for step in range(1, 6):
        seen.append(step)
        p.saw(forward)       # the batch that replays the step's programs
        p.saw(program)       # a replayed program's own instructions
        p.saw([("adam_foreach", 7, (), 1, None), ("adam_steps", 8, (), 1, None),
               ("adam_foreach", 9, (), 1, None)])  # two parameter groups: one step
    assert events == [("open", 2), ("close", 4)]
    assert (tmp_path / "worker1.json").exists()


def test_torch_profiler_calls_record_a_trace_of_the_scheduled_steps(tmp_path):
    """nanoGPT's bench.py profiles with torch.profiler: the same calls on gtmpi record the
    schedule's active steps as a trace, hand it to tensorboard_trace_handler as Chrome JSON,
    and key_averages() counts the workers' ops of those steps."""
    prof_api = gtmpi.profiler
    x = gtmpi.randn(8, 8, device="cuda")
    with prof_api.profile(activities=[prof_api.ProfilerActivity.CPU,
                                      prof_api.ProfilerActivity.CUDA],
                          schedule=prof_api.schedule(wait=1, warmup=1, active=2),
                          on_trace_ready=prof_api.tensorboard_trace_handler(str(tmp_path)),
                          record_shapes=False, profile_memory=False, with_stack=False,
                          with_flops=True, with_modules=False) as prof:
        for step in range(5):
            with prof_api.record_function(f"step{step}"):
                for _ in range(step + 1):
                    x = (x @ x).tanh()
            prof.step()
    files = list(tmp_path.glob("*.pt.trace.json"))
    assert len(files) == 1  # one window: steps 2 and 3
    events = json.loads(files[0].read_text())["traceEvents"]
    names = [e["name"] for e in events]
    assert "step2" in names and "step3" in names and "step1" not in names and "step4" not in names
    rows = {r["op"]: r["count"] for r in prof.key_averages()}
    assert rows["matmul"] == 3 + 4 and rows["tanh"] == 7  # steps 2 and 3 only
    assert "matmul" in prof.key_averages().table(sort_by="count", row_limit=5)
    assert not gtmpi.trace.active()


def test_profiler_schedule_is_torchs():
    import torch
    for kw in ({"wait": 1, "warmup": 1, "active": 2}, {"wait": 0, "warmup": 2, "active": 1,
               "repeat": 2, "skip_first": 3}):
        ours, theirs = gtmpi.profiler.schedule(**kw), torch.profiler.schedule(**kw)
        assert [ours(i).name for i in range(20)] == [theirs(i).name for i in range(20)]


def test_the_memory_reading_names_what_was_live_at_the_peak(tmp_path, capsys):
    """GTMPI_MEMORY_HISTORY's reading (gtmpi.trace.memory) replays allocations and frees: the
    peak, what was live then by allocation site (a graph capture's marked), and the peak of a
    later part of the run."""
    import pickle
    from gtmpi.trace import memory

    def alloc(addr, size, *frames):
        return {"action": "alloc", "addr": addr, "size": size,
                "frames": [{"filename": f"/x/{f.split(':')[0]}", "line": int(f.split(':')[1]),
                            "name": f.split(':')[2]} for f in frames]}

    def free(addr):
        return {"action": "free_requested", "addr": addr, "size": 0, "frames": []}

    events = [alloc(1, 100, "table.py:10:_linear", "executor.py:5:run"),
              alloc(2, 300, "table.py:20:_attention", "executor.py:6:_captured",
                    "graphs.py:89:capture"),
              alloc(3, 50, "table.py:10:_linear", "executor.py:5:run"),
              free(3), free(1),                    # the peak (450) was before these frees
              alloc(4, 120, "table.py:30:zeros"),  # the peak of the last part: 420
              free(4)]
    at, live, course = memory.peak(events)
    assert course == [100, 400, 450, 400, 300, 420, 300]
    assert at == 2 and set(live) == {1, 2, 3}
    at, live, _ = memory.peak(events, start=0.6)
    assert at == 5 and set(live) == {2, 4}
    path = tmp_path / "worker1.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [events[:5]]}))
    memory.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "peak 0.000 GB" in out and "3 blocks" in out
    assert "[graph] table.py:20 _attention" in out and "table.py:10 _linear" in out
    linear = next(line for line in out.splitlines() if "_linear" in line)
    assert linear.split()[1] == "2"  # two blocks allocated there
    memory.main([str(path), "--from", "0.8"])  # the last event's state alone
    assert "1 blocks" in capsys.readouterr().out


def test_top_after_a_client_leaves_shows_no_negative_rate_and_the_servers_memory():
    """gtmpi-trace top's frame when a client left between two pushes: its counters went with
    it; the rates are those of the slots still there, idle within 0-100%."""
    from gtmpi.monitor.top import render

    def slot(ops, exec_ns):
        return {"ops": ops, "control": 0, "collectives": 0, "transfers": 0,
                "exec_ns": exec_ns, "wait_ns": 0, "held_bytes": 4_000_000, "tensors": 2}

    before = {"1": {"time": 10.0, "slots": {"0": slot(0, 0), "1": slot(5000, 9 * 10 ** 8),
                                            "2": slot(100, 10 ** 7)}}}
    now = {"kind": "server", "up_s": 12, "monitors": 1, "clients": [], "workers": {
        "1": {"time": 11.0, "device": "cpu", "memory_bytes": 4_000_000,
              "slots": {"0": slot(0, 0), "2": slot(300, 2 * 10 ** 8)}}}}
    row = next(line for line in render(now, before).splitlines() if line.split()[:1] == ["1"])
    cells = row.split()
    assert cells[2] == "200" and cells[7:10] == ["19.0", "0.0", "81.0"], row
    assert cells[10] == "4.0", row  # the clients' tensors on this worker, MB


def test_a_cpu_workers_pushed_memory_is_its_clients_tensors():
    from gtmpi.monitor.push import figures
    from gtmpi.transport.local import LocalLink
    from gtmpi.worker.executor import Executor

    server = Executor(1, torch.device("cpu"), LocalLink())
    client = Executor(1, torch.device("cpu"), LocalLink())
    client.env[7] = torch.zeros(1000)
    got = figures({0: server, 3: client})
    assert got["memory_bytes"] == 4000 and got["slots"]["3"]["held_bytes"] == 4000


def test_the_monitors_busy_counts_a_running_batch_as_it_goes():
    """A batch counted only at its end read as more than 100% busy in the second it ended in
    (166% was seen): the monitor's figures count the running batch up to now, and top shows at
    most 100%."""
    import time as _time
    from gtmpi.monitor import push, top
    ex = types.SimpleNamespace(stats={k: 0 for k in ("ops", "control", "batches", "faults",
                                                      "exec_ns", "wait_ns", "bytes_received",
                                                      "bytes_sent")},
                               plane=None, env={}, _held_bytes=lambda: 0, batch_start=None,
                               device=torch.device("cpu"), memory=lambda: {})
    idle = push.figures({0: ex})["slots"]["0"]["exec_ns"]
    ex.batch_start = _time.perf_counter_ns() - 2_000_000_000  # running for 2 s
    running = push.figures({0: ex})["slots"]["0"]["exec_ns"]
    assert idle == 0 and running >= 2_000_000_000
    rates = top._slot_rates({"exec_ns": 3_000_000_000}, {"exec_ns": 0}, 1.0)
    assert rates["busy"] == 100.0


@pytest.mark.skipif(len(WORKERS) < 2, reason="needs 2 or more workers (the MPI suite)")
def test_summary_and_comms_count_the_same_bytes_per_collective(tmp_path):
    """ZeRO-3 on two workers: all-gathers (a piece in, the whole out), reduce-scatters (the
    whole in, a piece out) and all-reduces; the workers' events (summary) and the dispatcher's
    inserted records (comms) give each kind the same count and bytes: what each member puts
    in (summary counted an all-gather's whole result, twice comms' bytes)."""
    path = str(tmp_path / "zero3.h5")
    gtmpi.load_config({"z3_params": {"shard": {"workers": [0, 1], "replicated": True},
                                     "zero": 3},
                       "z3_data": {"shard": {"axis": 0, "workers": [0, 1]}}})
    gtmpi.manual_seed(0)
    model = gtmpi.nn.Sequential(gtmpi.nn.Linear(8, 16), gtmpi.nn.ReLU(), gtmpi.nn.Linear(16, 4))
    gtmpi.signal.place(model, "z3_params")
    opt = gtmpi.optim.AdamW(model.parameters(), lr=1e-3)
    gtmpi.synchronize()
    gtmpi.trace.start(path)
    for _ in range(2):
        x = gtmpi.signal.tensor(torch.randn(6, 8), "z3_data")
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    gtmpi.synchronize()
    gtmpi.trace.stop()
    trace = fileformat.read(path)
    summary = {r["collective"]: (r["count"], r["bytes"]) for r in analysis.collective_rows(trace)}
    comms: dict = {}
    for r in analysis.comm_rows(trace):
        count, nbytes = comms.get(r["kind"], (0, 0))
        comms[r["kind"]] = (count + r["count"], nbytes + r["bytes"])
    assert "all_gather" in summary and any(k.startswith("reduce_scatter") for k in summary)
    assert summary == comms
