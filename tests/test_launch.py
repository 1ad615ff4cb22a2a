"""Whole jobs as a user starts them: mpiexec, python -m gtmpi, plain python, gtmpi.workers(n),
and how they end: clean exit codes, uncaught exceptions, killed workers. Each job is bounded."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from gtmpi.transport import ending

from conftest import UNDER_MPI, is_open_mpi, launcher_env, mpiexec, run_job

MPIEXEC = mpiexec()
pytestmark = [
    pytest.mark.skipif(UNDER_MPI, reason="starts its own jobs; run once, from the serial suite"),
    pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec"),
]
LIMIT_S = 90


def run(tmp_path, body: str, **kw):
    return run_job(tmp_path, body, LIMIT_S, **kw)


def deaths_naming(tmp_path, body: str):
    """A job that a killed rank ends, and its lines saying who died."""
    proc, elapsed = run(tmp_path, body)
    return proc, elapsed, [line for line in proc.stderr.splitlines() if "died" in line]


def test_mpiexec_rank0_runs_the_program_workers_exit_zero(tmp_path):
    proc, _ = run(tmp_path, """
        import os, json, gtmpi
        x = gtmpi.arange(6.0).reshape(2, 3)
        print("PROGRAM", json.dumps({"pid": os.getpid(), "value": (x @ x.T).tolist(),
              "workers": sorted(gtmpi.info()["workers"])}))
    """)
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("PROGRAM")]
    assert len(lines) == 1  # workers never run the rest of the program
    out = json.loads(lines[0].split(" ", 1)[1])
    assert out["value"] == [[5.0, 14.0], [14.0, 50.0]] and out["workers"] == [1, 2]
    assert proc.stderr == ""  # nothing printed by default


@pytest.mark.parametrize("start", ["mpiexec", "spawn"])
def test_rank0_may_take_its_time_to_exit_after_the_workers(tmp_path, start):
    """Workers end after MPI_Finalize while rank 0 is still exiting (here: in its last exit
    handler). A worker that leaves without telling the process manager it finalized gets
    every process still running killed: MPICH's hydra SIGKILLs rank 0 (the job's exit code
    is then sometimes 9, sometimes 0), and its spawn helper the parent's process group."""
    proc, _ = run(tmp_path, """
        import atexit, sys, time
        atexit.register(lambda: (time.sleep(1.0), print("LAST", flush=True)))  # after Finalize
        if sys.argv[1] == "mpiexec":
            from mpi4py import MPI
            atexit.register(MPI.Finalize)
        import gtmpi
        if sys.argv[1] == "spawn":
            gtmpi.workers(2)
        print("VALUE", (gtmpi.ones(3) * 2).sum().item())
    """, n=3 if start == "mpiexec" else None, args=[start])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "VALUE 6.0" in proc.stdout and "LAST" in proc.stdout, proc.stdout + proc.stderr


def test_python_m_gtmpi_with_a_late_import_and_arguments(tmp_path):
    proc, _ = run(tmp_path, """
        import sys
        def main():
            import gtmpi
            print("ARGS", sys.argv[1:], len(gtmpi.info()["workers"]), gtmpi.ones(3).sum().item())
        main()
    """, module=True, args=("--lr", "0.1"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ARGS") == 1 and "ARGS ['--lr', '0.1'] 2 3.0" in proc.stdout


def test_plain_python_is_the_embedded_default(tmp_path):
    proc, _ = run(tmp_path, """
        import gtmpi
        info = gtmpi.info()
        print(info["embedded"], len(info["workers"]), (gtmpi.ones(2) * 3).tolist())
    """, n=None)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True 1 [3.0, 3.0]"


def test_embedded_worker_process_trains_and_leaves_with_the_program(tmp_path):
    """The embedded default's worker process (a GPU's default; chosen here on the CPU):
    training equals the in-process worker's, errors poison as usual, and the worker ends with
    the program."""
    body = """
        import json, os, torch, gtmpi, gtmpi.nn as nn, gtmpi.nn.functional as F
        gtmpi.manual_seed(1)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
        opt = gtmpi.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = gtmpi.randn(32, 8), gtmpi.tensor(torch.randint(0, 4, (32,), generator=torch.Generator().manual_seed(2)))
        losses = []
        for _ in range(5):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        big = gtmpi.arange(400_000.0).numpy()  # 1.6 MB: past what rides in a batch's reply
        try:
            gtmpi.arange(3, device="cuda")[gtmpi.tensor([5])].tolist()
            error = None
        except gtmpi.WorkerError as e:
            error = "index" in str(e)
        pid = gtmpi.info()["workers"][1]["pid"]
        try:
            after = (gtmpi.ones(2, device="cuda") * 2).tolist()
        except gtmpi.WorkerError as e:
            after = str(e)
        print("OUT", json.dumps({"losses": losses, "error": error, "own": pid == os.getpid(),
                                 "pid": pid, "after": after,
                                 "big": [float(big[0]), float(big[-1]), len(big)]}))
    """
    results = {}
    for mode in ("1", "0"):
        proc, _ = run(tmp_path, body, n=None, env={"GTMPI_EMBEDDED_PROCESS": mode})
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ""
        results[mode] = json.loads(proc.stdout.split("OUT ", 1)[1])
    child, inline = results["1"], results["0"]
    assert child["losses"] == inline["losses"] and child["losses"][-1] < child["losses"][0]
    assert child["error"] and child["after"] == inline["after"]
    if os.environ.get("GTMPI_TEST_JOB_DEVICE", "cpu") == "cpu":
        assert child["after"] == [2.0, 2.0]
    else:  # checked on the GPU (worker/bounds.py): every later read fails, naming the bad op
        assert "index out of range" in child["after"] and "prog.py:16" in child["after"]
    assert child["big"] == [0.0, 399_999.0, 400_000]
    assert not child["own"] and inline["own"]
    assert not os.path.exists(f"/proc/{child['pid']}")  # gone with the program


def test_a_killed_embedded_worker_process_is_named(tmp_path):
    proc, elapsed = run(tmp_path, """
        import os, signal, gtmpi
        x = gtmpi.ones(3, device="cuda")  # on the worker (a CPU tensor is the program's own)
        x.sum().item()
        os.kill(gtmpi.info()["workers"][1]["pid"], signal.SIGKILL)
        print((x + 1).sum().item())
    """, n=None, env={"GTMPI_EMBEDDED_PROCESS": "1"})
    assert proc.returncode != 0
    assert "worker rank 1" in proc.stderr and "exit status -9" in proc.stderr
    assert elapsed < 30


def test_workers_n_spawns_processes_from_plain_python(tmp_path):
    proc, _ = run(tmp_path, """
        import os, gtmpi
        gtmpi.workers(2)
        info = gtmpi.info()
        pids = {w["pid"] for w in info["workers"].values()}
        x = gtmpi.arange(4.0)
        print(info["embedded"], len(pids), os.getpid() in pids, (x * x).sum().item())
    """, n=None)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False 2 False 14.0"


EMBEDDED_CHILDREN = """
        def children():  # this process's embedded worker processes, alive or not yet reaped
            found = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                    cmd = open(f"/proc/{pid}/cmdline").read()
                except OSError:
                    continue
                if int(stat[1]) == os.getpid() and "gtmpi.worker.child" in cmd:
                    found.append(int(pid))
            return found
"""


@pytest.mark.parametrize("change", [False, True])
def test_the_embedded_worker_process_starts_while_gtmpi_is_imported(tmp_path, change):
    """transport.early: the worker's process starts first thing in `import gtmpi` and is the
    session's worker; an environment changed after the import (which the worker must see)
    gets a fresh one, and the early one is gone."""
    proc, _ = run(tmp_path, """
        import os, json
        import gtmpi
    """ + EMBEDDED_CHILDREN + f"""
        at_import = children()
        if {change}:
            os.environ["GTMPI_SOME_SETTING"] = "1"
        x = gtmpi.ones(3, device="cuda")
        print("OUT", json.dumps({{"sum": x.sum().item(), "at_import": at_import,
                                  "now": children(), "pid": gtmpi.info()["workers"][1]["pid"]}}))
    """, n=None, env={"GTMPI_EMBEDDED_PROCESS": "1", "GTMPI_VERBOSE": "1"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.split("OUT ", 1)[1])
    assert out["sum"] == 3.0 and len(out["at_import"]) == 1 and out["now"] == [out["pid"]]
    if change:
        assert out["pid"] != out["at_import"][0]
        assert "started now (not the one started at import: the environment changed since)" \
            in proc.stderr
    else:
        assert out["pid"] == out["at_import"][0] and "started at import" in proc.stderr


def test_workers_n_ends_the_worker_process_started_at_import(tmp_path):
    proc, _ = run(tmp_path, """
        import os, gtmpi
    """ + EMBEDDED_CHILDREN + """
        before = len(children())
        gtmpi.workers(2)
        print(before, len(children()), (gtmpi.arange(4.0) * 2).sum().item())
    """, n=None, env={"GTMPI_EMBEDDED_PROCESS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1 0 12.0"


def test_workers_after_first_op_is_an_error(tmp_path):
    proc, _ = run(tmp_path, """
        import gtmpi
        gtmpi.ones(1)
        try:
            gtmpi.workers(3)
        except RuntimeError as e:
            print("ERR", e)
    """, n=None)
    assert "ERR" in proc.stdout and "before the first tensor op" in proc.stdout


def test_uncaught_exception_ends_the_job_with_status_1_and_no_deaths(tmp_path):
    proc, elapsed = run(tmp_path, """
        import gtmpi
        x = gtmpi.ones(3) + 1
        x.tolist()
        raise ValueError("boom in the user program")
    """)
    assert proc.returncode == 1, proc.stderr
    assert "ValueError: boom in the user program" in proc.stderr
    assert "died" not in proc.stderr and "BAD TERMINATION" not in proc.stdout + proc.stderr
    assert elapsed < 30


def test_killed_worker_ends_the_job_naming_its_rank_alone(tmp_path):
    proc, elapsed, deaths = deaths_naming(tmp_path, """
        import os, signal, time, gtmpi
        x = gtmpi.ones(3)
        x.sum().item()
        os.kill(gtmpi.info()["workers"][2]["pid"], signal.SIGKILL)
        time.sleep(1)
        print((x + 1).sum().item())
        time.sleep(60)
    """)
    assert proc.returncode != 0
    assert len(deaths) == 1 and "worker rank 2 " in deaths[0], proc.stderr
    assert elapsed < 30


def test_killed_rank0_is_named_not_its_workers(tmp_path):
    proc, elapsed, deaths = deaths_naming(tmp_path, """
        import os, signal, gtmpi
        gtmpi.ones(3).sum().item()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert proc.returncode != 0
    assert len(deaths) == 1 and "rank 0 (pid" in deaths[0], proc.stderr
    assert elapsed < 30


@pytest.mark.skipif(UNDER_MPI or is_open_mpi(MPIEXEC), reason="starts its own job; MPICH's segments")
@pytest.mark.parametrize("how", ["mpiexec", "plain python", "embedded worker process"])
def test_a_killed_job_leaves_no_shared_memory_segment(tmp_path, how):
    """MPICH's segments (/dev/shm/mpich_shm_*) outlived every job killed before MPI_Finalize
    (977 of them here after a day of tests, 2.4 GB); unlinked once every rank has attached,
    none stays behind. A process alone in its job (plain python, the embedded worker's own
    process) unlinks its own at once."""
    import glob
    before = set(glob.glob("/dev/shm/mpich_shm_*"))
    proc, _ = run_job(tmp_path, """
        import os, signal, gtmpi
        print(gtmpi.ones(3, device="cuda").sum().item(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """, 60, n=3 if how == "mpiexec" else None,
        env={"GTMPI_EMBEDDED_PROCESS": "1"} if how == "embedded worker process" else None)
    assert proc.returncode != 0 and "3.0" in proc.stdout, proc.stdout + proc.stderr
    # the workers end once they see rank 0 gone: on a loaded host, some seconds later
    deadline = time.monotonic() + 60
    while (left := set(glob.glob("/dev/shm/mpich_shm_*")) - before) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left


def _until(predicate, limit_s: float = 60.0) -> None:
    """Wait until ``predicate`` holds: the bound is for a bug, never for a slow host (two
    processes importing torch on a loaded 2-core machine once took past 10 s)."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _watchers(job: ending.Job) -> list[int]:
    """The pids of the death watchers of ``job``'s ranks."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"ending.py") for a in argv) and job[0].encode() in argv:
            pids.append(int(pid))
    return pids


def test_the_first_death_is_named_however_late_the_watchers_wake(tmp_path):
    """On a loaded host the launcher's kills of the other ranks could all land before the
    first death's watcher ran, and the time a watcher woke then named a rank the launcher
    killed (CI: 3 runs in 3 named a worker when rank 0 was killed). Here both watchers are
    stopped while rank 2 then rank 1 die, and the later death's watcher is let run first: the
    order comes from the kernel (epoll over the ranks' exits), not from when watchers ran."""
    job = (f"test-{tmp_path.name}", os.getpid())
    ranks = {r: subprocess.Popen(
        [sys.executable, "-c", "import time; from gtmpi.transport import ending; "
         f"notice = ending.DeathNotice({r}, {job!r}); time.sleep(300)"],
        stderr=subprocess.PIPE, text=True) for r in (1, 2)}
    try:
        _until(lambda: len(ending._registered(job)) == 2 and len(_watchers(job)) == 2)
        time.sleep(3 * ending.RESCAN_S)  # each watcher has found the other rank registered
        watchers = _watchers(job)
        for pid in watchers:
            os.kill(pid, signal.SIGSTOP)
        ranks[2].kill()
        ranks[2].wait()
        ranks[1].kill()
        ranks[1].wait()
        late = {pid for pid in watchers if str(ranks[1].pid).encode() in
                open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")}
        for pid in late:
            os.kill(pid, signal.SIGCONT)
        _until(lambda: 1 in ending._notes(job))
        for pid in set(watchers) - late:
            os.kill(pid, signal.SIGCONT)
        _until(lambda: 2 in ending._notes(job))
        notes = ending._notes(job)
        assert notes[1][1] < notes[2][1]  # the time the watchers woke would name rank 1
        assert notes[2][0] == ending.FIRST and notes[1][0] == ending.AFTER
        assert ending.first(job) == 2
    finally:
        for proc in ranks.values():
            proc.kill()
    assert "worker rank 2 " in ranks[2].communicate(timeout=20)[1]
    assert "died" not in ranks[1].communicate(timeout=20)[1]


def test_rank_0_waits_for_the_notes_of_the_workers_it_found_dead(tmp_path):
    """A worker killed a moment after another is found dead with it, before the first one's
    watcher has written its note: that note is waited for."""
    job = (f"test-{tmp_path.name}", os.getpid())
    with open(f"{ending._path(job)}.1", "w") as f:
        f.write("200 0")
    late = threading.Timer(0.3, lambda: open(f"{ending._path(job)}.2", "w").write("100 0"))
    late.start()
    try:
        assert ending.first(job) == 1
        assert ending.first(job, (1, 2), wait_s=5.0) == 2
    finally:
        late.join()
        for rank in (1, 2):
            os.unlink(f"{ending._path(job)}.{rank}")


@pytest.mark.parametrize("how, status", [("mpiexec", 1), ("spawned", 1), ("embedded", 130)])
def test_ctrl_c_is_one_line(tmp_path, how, status):
    """Status 1 as for any uncaught exception in an MPI job; a plain process ends as Python
    does on Ctrl-C (130 in the shell)."""
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(f"""
        import gtmpi
        if {how == "spawned"}:
            gtmpi.workers(2)
        x = gtmpi.randn(64, 64)
        print("ready", flush=True)
        while True:
            x = (x @ x).tanh()
            x.sum().item()
    """))
    cmd = [sys.executable, str(script)]
    if how == "mpiexec":
        cmd = [MPIEXEC, "-n", "3"] + cmd
    env = {**os.environ, **launcher_env(), "GTMPI_DEVICE": "cpu", "GTMPI_EMBEDDED_PROCESS": "1"}
    # a terminal's program takes Ctrl-C; a suite started in the background (`... &` in a
    # script) would pass on an ignored SIGINT, and the program would never see it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode in (status, -signal.SIGINT if status == 130 else status), err
    ours = [line for line in err.splitlines() if line.startswith("gtmpi:")]
    # Open MPI's mpiexec passes a Ctrl-C on to its ranks as SIGTERM: they cannot tell it apart
    said = "stopped (SIGTERM) at " if how == "mpiexec" and is_open_mpi(MPIEXEC) \
        else "interrupted (Ctrl-C) at "
    assert len(ours) == 1 and said in ours[0] and "prog.py:" in ours[0], err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_a_fault_in_spawned_workers_leaves_the_callers_shell_alone(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import gtmpi
        gtmpi.workers(2)
        gtmpi.ones(3).sum().item()
        raise ValueError("boom")
    """))
    shell = f'"{sys.executable}" "{script}"; echo "python said $?"; echo "the shell goes on"'
    proc = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=LIMIT_S,
                          env={**os.environ, **launcher_env(), "GTMPI_DEVICE": "cpu"},
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-2:] == ["python said 1", "the shell goes on"], proc.stdout
    assert "ValueError: boom" in proc.stderr and "died" not in proc.stderr


def test_srun_without_pmi_stops_every_copy_saying_how_to_launch(tmp_path):
    body = """
        import gtmpi
        print("ran the program")
    """
    env = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "3", "SLURM_PROCID": "0"}
    first, _ = run(tmp_path, body, n=None, env=env)
    other, _ = run(tmp_path, body, n=None, env={**env, "SLURM_PROCID": "2"})
    assert first.returncode == 1 and other.returncode == 1
    assert "ran the program" not in first.stdout + other.stdout
    assert "srun --mpi=" in first.stderr and "SLURM_STEP_NUM_TASKS=3" in first.stderr
    assert other.stderr == ""
    alone, _ = run(tmp_path, body, n=None, env={**env, "SLURM_STEP_NUM_TASKS": "1"})
    assert alone.returncode == 0 and "ran the program" in alone.stdout


def test_same_random_numbers_whatever_the_worker_count(tmp_path):
    body = """
        import gtmpi
        gtmpi.manual_seed(42)
        a = gtmpi.randn(4)
        print("R", [round(v, 6) for v in (a + gtmpi.rand(4)).tolist()])
    """
    outs = []
    for n in (None, 2, 3):
        proc, _ = run(tmp_path, body, n=n)
        assert proc.returncode == 0, proc.stderr
        outs.append([l for l in proc.stdout.splitlines() if l.startswith("R")])
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 1


def test_verbose_prints_start_up(tmp_path):
    proc, _ = run(tmp_path, "import gtmpi\ngtmpi.ones(1).item()\n", env={"GTMPI_VERBOSE": "1"})
    assert proc.returncode == 0
    assert "gtmpi: worker rank 1" in proc.stderr and "gtmpi: worker rank 2" in proc.stderr


def test_slurm_variables_choose_the_local_index(tmp_path):
    """As srun starts one dispatcher task and two worker tasks on one node."""
    script = tmp_path / "prog.py"
    script.write_text("import gtmpi\nprint('IDX', sorted((r, w['local_index']) for r, w in "
                      "gtmpi.info()['workers'].items()))\n")
    cmd = [MPIEXEC]
    for local_id in (0, 1, 6):
        if local_id:
            cmd.append(":")
        setenv = (["-x", f"SLURM_LOCALID={local_id}"] if is_open_mpi(MPIEXEC)
                  else ["-env", "SLURM_LOCALID", str(local_id)])
        cmd += ["-n", "1", *setenv, sys.executable, str(script)]
    env = {**os.environ, **launcher_env(), "GTMPI_DEVICE": "cpu", "SLURM_STEP_ID": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S, env=env,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    # SLURM_LOCALID wins over the MPI node split: 1 -> 0, and 6 -> 5 (dispatcher on the node)
    assert "IDX [(1, 0), (2, 5)]" in proc.stdout


def test_idle_ranks_do_not_spin(tmp_path):
    """An idle worker, and rank 0 waiting on a long read, sleep instead of spinning a core."""
    proc, _ = run(tmp_path, """
        import os, time, gtmpi
        def cpu_s(pid):
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        gtmpi.ones(1).item()
        pids = [w["pid"] for w in gtmpi.info()["workers"].values()]
        before = [cpu_s(p) for p in pids]
        time.sleep(2.0)
        idle = [cpu_s(p) - b for p, b in zip(pids, before)]
        a = gtmpi.randn(1500, 1500)
        ((a @ a) * 1e-3).sum().item()  # shapes inferred and cached before the timed wait
        c = a
        start, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(8):
            c = (c @ a) * 1e-3
        c.sum().item()
        print("IDLE", max(idle), "WAIT", time.process_time() - cpu0, time.perf_counter() - start)
    """)
    assert proc.returncode == 0, proc.stderr
    idle, wait_cpu, wait_wall = map(float, proc.stdout.split("IDLE")[1].replace("WAIT", "").split())
    assert idle < 0.3, f"an idle worker used {idle:.2f} s of CPU in 2 s"
    assert wait_cpu < 0.25 * wait_wall + 0.05, (wait_cpu, wait_wall)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("n", [None, 3])
def test_examples_run(n):
    """The README's demo and the MLP example (≥ 95% test accuracy) under plain python and mpiexec,
    and under mpiexec the GPT example with sequence parallelism (its gathers and
    reduce-scatters): no warning and no file of gtmpi's own in anything they print.
    Each takes seconds; the bound is wide because a busy 2-core machine (CI beside another job)
    once took the MLP past 90 s, and a test's pass must not depend on the machine being idle."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("GTMPI_VERBOSE", "PYTHONWARNINGS")}
    env.update({**launcher_env(), "GTMPI_DEVICE": "cpu"})
    runs = [[os.path.join(root, "examples", "demo.py")],
            [os.path.join(root, "examples", "train_mlp.py")]]
    if n is not None:
        runs.append([os.path.join(root, "examples", "gpt", "train.py"), "--size", "tiny",
                     "--steps", "2", "--eval-batches", "1"])
    for run in runs:
        cmd = [sys.executable, *run]
        if n is not None:
            cmd = [MPIEXEC, "-n", str(n)] + cmd
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200,
                              env={**env, "GTMPI_CONFIG": os.path.join(
                                  root, "configs", "gpt_tp2_sp.yaml")} if len(run) > 1 else env,
                              start_new_session=True)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        printed = proc.stdout + proc.stderr
        assert "Warning" not in printed and not re.search(r"gtmpi/\w+/\w+\.py", printed), printed
        if run[0].endswith("train_mlp.py"):
            assert "test accuracy" in proc.stdout


def test_end_files_live_in_a_private_folder_and_a_new_job_clears_an_old_ones(tmp_path):
    """A claim left by a job whose processes were all killed (SLURM's SIGTERM to every rank)
    once silenced the "died" line of a later job whose rank 0 got the same pid; and the claims
    lay in the shared temporary folder, where any user could make one."""
    job = (f"test-{tmp_path.name}", os.getpid())
    folder = os.path.dirname(ending._path(job))
    assert (os.stat(folder).st_mode & 0o777) == 0o700 and os.stat(folder).st_uid == os.getuid()
    assert ending.claim(job, "")
    for name in (".1", "-pid.1"):
        with open(ending._path(job) + name, "w") as f:
            f.write("1 0")
    assert ending.claimed(job) and not ending.claim(job, "")
    ending.clear(job)
    assert not ending.claimed(job) and ending.first(job) is None and not ending._registered(job)
    assert ending.claim(job, "")
    ending.clear(job)


def test_a_rank_spins_in_its_waits_only_where_each_rank_of_its_host_has_a_core(monkeypatch):
    from gtmpi.transport import poll
    monkeypatch.setattr(poll, "SPIN_S", poll.SPIN_S)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    poll.spin_where_cores_spare(3)  # mpiexec -n 3 on a 2-core machine
    assert poll.SPIN_S == 0.0
    poll.spin_where_cores_spare(2)
    assert poll.SPIN_S == 0.002
