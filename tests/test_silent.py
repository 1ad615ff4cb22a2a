"""Nothing silent: configs that cannot be ignored. A misspelt signal name, a config that needs
more workers than launched or leaves some idle, a config train.py does not understand: each is
said, never run through quietly on fewer workers than meant."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import gtmpi
from conftest import launcher_env, mpiexec, run_job

ROOT = Path(__file__).resolve().parent.parent
serial = pytest.mark.skipif(len(gtmpi.info()["workers"]) > 1 or mpiexec() is None,
                            reason="starts its own jobs; run once, from the serial suite")


@serial
def test_config_signals_the_program_never_used_are_named_at_exit(tmp_path):
    proc, _ = run_job(tmp_path, """
        import warnings, torch, gtmpi
        gtmpi.load_config({"dat": {"shard": {"axis": 0, "workers": [0, 1]}},
                           "weights": {"shard": {"workers": [0, 1], "replicated": True}}})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = gtmpi.signal.tensor(torch.ones(4, 2), "data")
        print(caught[0].message)
        with gtmpi.signal.context("weights"):
            w = gtmpi.ones(2)
        print((x * w).sum().item())
    """, 90)
    assert proc.returncode == 0, proc.stderr
    assert "signal 'data' is not in the config (did you mean 'dat'?)" in proc.stdout
    assert "gtmpi: the config's signal(s) dat were never used by the program; it used data, " \
           "which the config lacks" in proc.stderr


@serial
def test_a_config_needing_more_workers_says_how_many_ranks_to_launch(tmp_path):
    proc, _ = run_job(tmp_path, """
        import gtmpi
        gtmpi.load_config({"wide": {"shard": {"axis": 0, "workers": [0, 1, 2, 3]}}})
    """, 90)
    assert proc.returncode != 0
    assert "the config needs 4: launch 5 ranks (mpiexec -n 5" in proc.stderr, proc.stderr


@serial
def test_workers_a_config_leaves_idle_are_said_once(tmp_path):
    proc, _ = run_job(tmp_path, """
        import gtmpi
        gtmpi.load_config({"one": {"shard": {"workers": [0]}}})
        gtmpi.load_config({"also": {"shard": {"workers": [0]}}})
    """, 90, n=4)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("places nothing on worker(s) 1, 2 of 3: they stay idle") == 1


@serial
@pytest.mark.parametrize("config, said", [
    ("dat:\n  shard: {axis: 0, workers: [0]}\nweight:\n  shard: {workers: [0], "
     "replicated: true}\n", "'dat' (did you mean 'data'?), 'weight' (did you mean 'weights'?)"),
    (None, "'col', 'row', 'weights' name no layout this script runs; tensor parallel also "
           "needs 'act', 'rep'; data parallel also needs 'data'.")])
def test_train_py_refuses_a_config_it_does_not_understand(tmp_path, config, said):
    path = tmp_path / "c.yaml"
    if config is None:  # tensor_parallel.yaml is for the MLP, not the GPT's signals
        path = ROOT / "configs" / "tensor_parallel.yaml"
    else:
        path.write_text(config)
    proc, _ = run_job(tmp_path, f"""
        import runpy, sys
        sys.argv = ["train.py", "--steps", "2"]
        runpy.run_path({str(ROOT / "examples/gpt/train.py")!r}, run_name="__main__")
    """, 120, n=3, env={"GTMPI_CONFIG": str(path)})
    assert proc.returncode != 0
    assert said in proc.stderr, proc.stderr[-2000:]
    assert "did you mean 'col'" not in proc.stderr  # a name it knows is never its own hint


def _train_py(tmp_path, *args: str, n: int | None = None):
    return run_job(tmp_path, f"""
        import runpy, sys
        sys.argv = ["train.py", *{list(args)!r}]
        runpy.run_path({str(ROOT / "examples/gpt/train.py")!r}, run_name="__main__")
    """, 200, n=n)[0]


@serial
def test_resume_says_what_it_resumes_from_and_refuses_a_bad_checkpoint(tmp_path):
    ckpt = tmp_path / "run.pt"
    common = ("--layers", "1", "--steps", "6", "--log-every", "1", "--dtype", "fp32")
    fresh = _train_py(tmp_path, *common, "--checkpoint", str(ckpt), "--resume",
                      "--save-every", "3", "--stop-at", "3")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert f"no checkpoint at {ckpt} yet: training from step 0" in fresh.stdout
    import torch
    saved = torch.load(ckpt, weights_only=False)
    assert saved["step"] == 3 and len(saved["losses"]) == 3  # every loss up to its step
    resumed = _train_py(tmp_path, *common, "--checkpoint", str(ckpt), "--resume")
    assert resumed.returncode == 0 and f"resumed from {ckpt} at step 3" in resumed.stdout
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"")
    out = _train_py(tmp_path, *common, "--checkpoint", str(bad), "--resume")
    assert out.returncode != 0
    assert f"cannot resume from {bad}: not a readable checkpoint" in out.stderr
    torch.save({"weights": 1}, bad)
    out = _train_py(tmp_path, *common, "--checkpoint", str(bad), "--resume")
    assert f"cannot resume from {bad}: it lacks model, optimizer, step, losses" in out.stderr

    class Crafted:  # a pickle that calls a function as it loads: here, one that makes a file
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))
    torch.save({"model": Crafted(), "optimizer": {}, "step": 0, "losses": []}, bad)
    out = _train_py(tmp_path, *common, "--checkpoint", str(bad), "--resume")
    assert f"cannot resume from {bad}: not a readable checkpoint" in out.stderr
    assert "Weights only load failed" in out.stderr and not (tmp_path / "ran").exists()
    from test_nn import _flip_a_bit_of
    _flip_a_bit_of(ckpt, "data/0")
    out = _train_py(tmp_path, *common, "--checkpoint", str(ckpt), "--resume")
    assert f"cannot resume from {ckpt}: not a readable checkpoint" in out.stderr
    assert "is damaged" in out.stderr and "data/0" in out.stderr


def _kill_running(script: str, limit_s: float = 30) -> None:
    """SIGKILL every process of this host running ``script``, and wait until none runs (a
    rank that hydra put in a process group of its own outlives a kill of mpiexec's). A process
    once seen is waited for by its pid and start time: while a killed one exits its cmdline
    reads empty, yet it may still hold (and write) its files."""
    from gtmpi.transport.ending import alive

    def started(pid: int) -> str | None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[19]
        except (OSError, IndexError):
            return None

    deadline, seen = time.monotonic() + limit_s, {}
    while True:
        for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if script.encode() in f.read():
                        seen[pid] = started(pid)
            except OSError:
                continue
        # the same start time: not another process that took a dead one's pid
        pids = [pid for pid, at in seen.items() if alive(pid) and started(pid) == at]
        if not pids:
            return
        assert time.monotonic() < deadline, f"still running: {pids}"
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _until(proc, text: str, limit_s: float) -> str:
    """Read ``proc``'s stdout until a line holds ``text``."""
    seen, deadline = [], time.monotonic() + limit_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if text in line or not line:
            break
    return "".join(seen)


@serial
@pytest.mark.parametrize("whom", ["every rank", "mpiexec"])
def test_sigterm_saves_a_checkpoint_writes_the_trace_and_ends_with_one_line(tmp_path, whom):
    """SLURM's time limit (srun signals every task) or a kill of mpiexec (which forwards it):
    train.py saves its checkpoint after the step under way, rank 0 writes the final trace with
    every step it ran and says so in one line; the workers are ended cleanly, not 'died'."""
    ckpt, trace = tmp_path / "run.pt", tmp_path / "run.h5"
    cmd = [mpiexec(), "-n", "3", sys.executable, str(ROOT / "examples/gpt/train.py"),
           "--layers", "1", "--steps", "400", "--log-every", "1", "--checkpoint", str(ckpt),
           "--dtype", "fp32"]
    # the step's replays are counted below: its optimizer step and clip replay on their own
    # where captured
    env = {**os.environ, **launcher_env(), "GTMPI_DEVICE": "cpu", "GTMPI_TRACE": str(trace),
           "GTMPI_CAPTURE": "0"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        before = _until(proc, "step     5/", 120)
        assert "step     5/" in before, before + proc.stderr.read()
        if whom == "mpiexec":
            os.kill(proc.pid, signal.SIGTERM)
        else:  # the ranks, as srun does: each python process of the job
            for pid in _pids_of(" ".join(cmd[3:5])):
                os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(1)  # rank 0 outlives a forwarding mpiexec by the time the trace takes
    for _ in range(100):
        if trace.exists() and not _pids_of(" ".join(cmd[3:5])):
            break
        time.sleep(0.2)
    if whom == "every rank":
        assert proc.returncode != 0
    assert "died" not in err, err
    assert "gtmpi: stopped (SIGTERM)" in err and "train.py" in err, err
    import torch
    saved = torch.load(ckpt, weights_only=False)
    assert saved["step"] >= 5 and len(saved["losses"]) == saved["step"]
    from gtmpi.recording import fileformat
    from gtmpi.recording.events import Kind, Lane
    from gtmpi.trace import analysis
    written = fileformat.read(str(trace))
    assert written.meta["status"].startswith("failed: Terminated"), written.meta["status"]
    issued = analysis.select(written.events[0], (Kind.ISSUE,), Lane.CLIENT)
    replays = [written.name(int(n)) for n in issued["name"]].count("replay")
    assert replays == saved["step"] - 2  # every step it ran: 2 issued as written, then replays


def _pids_of(command: str) -> list[int]:
    """The processes whose command line starts with ``command`` (python and its script): a
    job's ranks, not mpiexec, nor another test's python (a pytest-xdist worker)."""
    out = subprocess.run(["pgrep", "-f", f"^{command}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@serial
def test_an_error_while_the_session_starts_ends_the_job_with_status_1(tmp_path):
    """A malformed GTMPI_CONFIG under mpiexec: the traceback, status 1, the workers ended
    cleanly (it was 9, from MPI_Abort, in 4 runs of 6)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    for _ in range(2):
        proc, _ = run_job(tmp_path, "import gtmpi\nprint(gtmpi.ones(2))\n", 90,
                          env={"GTMPI_CONFIG": str(bad)})
        assert proc.returncode == 1, (proc.returncode, proc.stderr[-1500:])
        assert "not valid YAML at line 2" in proc.stderr and "Abort" not in proc.stderr


@serial
def test_a_spawned_worker_killed_while_rank_0_is_idle_ends_the_job_naming_it(tmp_path):
    """gtmpi.workers(n): a worker killed while the program sleeps ends the job within seconds,
    named as the one that died (rank 0's next call used to find out, naming another)."""
    script = tmp_path / "prog.py"
    script.write_text("import time, gtmpi\n"
                      "gtmpi.workers(2)\n"
                      "gtmpi.ones(3, device='cuda').sum().item()\n"
                      "print('pids', {r: w['pid'] for r, w in gtmpi.info()['workers'].items()},"
                      " flush=True)\n"
                      "time.sleep(60)\n"
                      "print('woke', flush=True)\n")
    env = {**os.environ, **launcher_env(), "GTMPI_DEVICE": "cpu"}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        line = _until(proc, "pids", 90)
        pids = eval(line.split("pids ", 1)[1])
        os.kill(pids[2], signal.SIGKILL)
        start = time.monotonic()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.monotonic() - start < 15 and "woke" not in out
    assert proc.returncode == 1
    deaths = [line for line in err.splitlines() if "died" in line]
    assert deaths and f"worker rank 2 (pid {pids[2]}" in deaths[0], err


SAVE_LOOP = """
    import sys, gtmpi
    path = sys.argv[1]
    w = gtmpi.zeros(1 << 21, device="cuda")
    for k in range(1, 100000):
        w += 1
        gtmpi.save({"k": k, "w": w}, path)
        print("saved", k, flush=True)
"""


@serial
@pytest.mark.timeout(300)
def test_a_job_killed_while_saving_leaves_a_whole_checkpoint(tmp_path):
    """A job (2 workers) saving an 8 MB checkpoint over and over, SIGKILLed at random moments:
    the file at the path is always a whole checkpoint, the last one saved or the next.
    GTMPI_KILL_TRIALS sets the number of kills (3 by default)."""
    import random
    script, path = tmp_path / "prog.py", tmp_path / "ck.pt"
    script.write_text(textwrap.dedent(SAVE_LOOP))
    env = {**os.environ, **launcher_env(), "GTMPI_DEVICE": "cpu"}
    rng = random.Random(0)
    for trial in range(int(os.environ.get("GTMPI_KILL_TRIALS", "3"))):
        proc = subprocess.Popen([mpiexec(), "-n", "3", sys.executable, str(script), str(path)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env=env, start_new_session=True)
        try:
            saved = int(_until(proc, "saved", 90).split()[1])
            time.sleep(rng.uniform(0.0, 0.5))
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            _kill_running(str(script))  # ranks outside mpiexec's group: saving on, orphaned
        out, _ = proc.communicate(timeout=30)
        saved = max([saved] + [int(line.split()[1]) for line in out.splitlines()
                               if line.startswith("saved ")])
        got = gtmpi.load(path)  # checks every record's CRC-32
        assert got["k"] in (saved, saved + 1), (trial, saved, got["k"])
        assert bool((got["w"] == float(got["k"])).all()), trial
    gtmpi.save({"k": 0}, path)  # what the killed saves left behind is cleared by the next
    assert sorted(os.listdir(tmp_path)) == ["ck.pt", "prog.py"]
