"""A server shared by clients (gtmpi/server): each client gets what it gets alone, cannot reach
another's tensors, and may die without harming the others; the live monitor (gtmpi-trace top).

Every job here is bounded: the server by its own deadline, each client by a timeout."""
from __future__ import annotations

import io
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import UNDER_MPI, launcher_env, mpiexec
from gtmpi.transport.joining import LAUNCHER_ENV

MPIEXEC = mpiexec()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [
    pytest.mark.skipif(UNDER_MPI, reason="starts its own jobs; run once, from the serial suite"),
    pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec"),
]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GTMPI_VERBOSE", "GTMPI_TRACE", "GTMPI_CONFIG", "GTMPI_MONITOR")}
    env.update({**launcher_env(), "GTMPI_DEVICE": os.environ.get("GTMPI_TEST_JOB_DEVICE", "cpu"),
                "PYTHONPATH": ROOT, **extra})
    return env


# how long the tests' servers wait on a client that stopped (the hostile cases wait it out)
TIMEOUT_S = 4


class Server:
    """``mpiexec -n 3 python -m gtmpi.server`` (2 workers), stopped at the end of the test."""

    def __init__(self, tmp_path, *args: str, limit_s: float = 240) -> None:
        self.port_file = str(tmp_path / "server.port")
        self.log = open(tmp_path / "server.log", "w+")
        self.proc = subprocess.Popen(
            ["timeout", str(limit_s), MPIEXEC, "-n", "3", sys.executable, "-m",
             "gtmpi.server", "--port-file", self.port_file, *args],
            stdout=self.log, stderr=subprocess.STDOUT,
            env=_env(GTMPI_CLIENT_TIMEOUT_S=str(TIMEOUT_S)), start_new_session=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.port_file):
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, "no port file within 60 s: " + self.text()
            time.sleep(0.1)

    def text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def client(self, tmp_path, name: str, body: str, *args: str, **env: str) -> subprocess.Popen:
        script = tmp_path / f"{name}.py"
        script.write_text(textwrap.dedent(body))
        return subprocess.Popen(  # a client is a plain program: no launcher
            ["timeout", "150", sys.executable, str(script), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=_env(**{"GTMPI_CONNECT": self.port_file, **env}), start_new_session=True)

    def snapshot(self) -> dict:
        """What a monitor is sent (the workers' figures, the clients), after the next push."""
        from gtmpi.transport.rendezvous import dial, read_port_file
        lines = dial(read_port_file(self.port_file), {"role": "monitor"})
        asked = time.time()
        try:
            while (snap := lines.recv(timeout_s=10))["time"] < asked + 2.1:
                pass  # until every worker has pushed since it was asked
            return snap
        finally:
            lines.close()

    def stop(self, cli: bool = False) -> str:
        """Asked as ``python -m gtmpi.server --stop`` would ask (``cli``: by running it)."""
        if self.proc.poll() is None:
            if cli:
                asked = subprocess.run([sys.executable, "-m", "gtmpi.server", "--stop",
                                        "--port-file", self.port_file], env=_env(), timeout=60,
                                       capture_output=True, text=True)
                assert asked.returncode == 0 and "stopping" in asked.stderr, asked.stderr
            else:
                from gtmpi.transport.rendezvous import dial, read_port_file
                lines = dial(read_port_file(self.port_file), {"role": "stop"})
                assert lines.recv(timeout_s=10) == {"stopping": True}
                lines.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                raise AssertionError("the server did not stop within 30 s: " + self.text())
        return self.text()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the tests one after another, as a server lives: each test's clients,
    hostile ones included, must leave it serving the next."""
    s = Server(tmp_path_factory.mktemp("shared"), limit_s=900)  # the module's whole run
    yield s
    s.stop(cli=True)


def finish(proc: subprocess.Popen, limit_s: float = 150) -> str:
    """The client's output, without UCX's notes (MPICH over UCX may print one at exit)."""
    out, err = proc.communicate(timeout=limit_s)
    assert proc.returncode == 0, f"status {proc.returncode}\n{out}\n{err}"
    return "".join(line for line in out.splitlines(keepends=True) if "UCX  WARN" not in line)


GPT = [os.path.join(ROOT, "examples", "gpt", "train.py"), "--size", "tiny", "--steps", "8"]

MLP = """
    import gtmpi as t
    t.manual_seed(1)
    net = t.nn.Sequential(t.nn.Linear(8, 32), t.nn.ReLU(), t.nn.Linear(32, 1))
    opt = t.optim.SGD(net.parameters(), lr=0.05)
    x = t.randn(64, 8, device="cuda")
    y = (x[:, :1] * 2 - x[:, 1:2]).detach()
    for step in range(40):
        loss = ((net(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 8 == 0:
            print(f"{step} {loss.item():.6f}")
"""

READS = """
    import sys
    import gtmpi as t
    k = int(sys.argv[1])
    x = t.zeros(16, device="cuda")
    for i in range(1, 301):
        x = x + k
        assert float(x[3]) == i * k, (i, k, float(x[3]))
    print("reads", float(x.sum()))
"""


# a client reading until a file exists, each read timed: how long a bystander waits
BYSTANDER = """
    import os, sys, time
    import gtmpi as t
    x = t.zeros(16, device="cuda")
    n, slowest = 0, 0.0
    while not os.path.exists(sys.argv[1]):
        x = x + 1
        asked = time.perf_counter()
        assert float(x[3]) == n + 1
        slowest = max(slowest, time.perf_counter() - asked)
        n += 1
    print("reads", n, "slowest", slowest)
"""


def _gpt_losses(out: str) -> list[float]:
    return json.loads(out.strip().splitlines()[-1])["losses"]


@pytest.mark.timeout(400)
def test_three_clients_at_once_get_what_they_get_alone(server, tmp_path):
    starts = [lambda: server.client(tmp_path, "gpt", "import runpy, sys\nsys.argv = sys.argv[1:]\n"
                                    "runpy.run_path(sys.argv[0], run_name='__main__')\n", *GPT,
                                    GTMPI_CONFIG=os.path.join(ROOT, "configs", "data_parallel.yaml")),
              lambda: server.client(tmp_path, "mlp", MLP),
              lambda: server.client(tmp_path, "reads", READS, "7")]
    alone = [finish(start()) for start in starts]
    together = [finish(p) for p in [start() for start in starts]]
    assert _gpt_losses(together[0]) == _gpt_losses(alone[0])
    assert together[1:] == alone[1:]
    assert "reads 33600.0" in together[2]
    assert len(_gpt_losses(alone[0])) == 8


def test_the_port_file_is_the_owners_and_its_token_is_required(server, tmp_path):
    assert stat.S_IMODE(os.stat(server.port_file).st_mode) == 0o600
    from gtmpi.transport.rendezvous import dial, read_port_file
    info = read_port_file(server.port_file)
    # a wrong token: the server's proof does not match it, and the dialler stops there
    with pytest.raises(ConnectionRefusedError, match="did not prove it knows this port file"):
        dial({**info, "token": "guess"}, {"role": "client", "port": "x"})
    # a peer that skips the proofs and names the token (it learnt nothing from the server)
    import socket
    sock = socket.create_connection((info["host"], info["port"]), timeout=10)
    from gtmpi.transport.rendezvous import Lines
    lines = Lines(sock)
    lines.send({"token": info["token"], "role": "client"})
    assert "prove it knows the port file's token" in lines.recv(timeout_s=10)["refused"]
    lines.close()
    # a client given a forged port file stops with one clear error, its token never sent
    forged = tmp_path / "forged.port"
    forged.write_text(json.dumps({**info, "token": "0" * 48}))
    proc = server.client(tmp_path, "forged", "import gtmpi\ngtmpi.zeros(2).numpy()\n",
                         GTMPI_CONNECT=str(forged))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "did not prove it knows this port file" in err, err


ISOLATION_VICTIM = """
    import os, sys, time
    import gtmpi as t
    secret = t.arange(4.0, device="cuda") * 10
    ready, go = sys.argv[1], sys.argv[2]
    with open(ready, "w") as f:
        f.write(str(secret.id))
    while not os.path.exists(go):
        time.sleep(0.05)
    t.synchronize()
    print("secret", secret.numpy().tolist())
"""

ISOLATION_ATTACKER = """
    import sys
    import torch
    import gtmpi as t
    victim = int(open(sys.argv[1]).read())
    guesses = range(max(1, victim - 3), victim + 4)
    print("guesses", len(guesses))
    for guess in guesses:
        forged = t.Tensor(guess, (torch.Size([4]), torch.float32))
        try:
            forged.numpy()
            print("read", guess)
        except t.WorkerError as e:
            print("refused read", guess, str(e).splitlines()[0][:60])
        forged.add_(1000.0)  # an in-place write into whatever the id names here
        forged.id = None  # no free of what the forger never made
    try:
        t.synchronize()
    except t.WorkerError as e:
        print("write skipped:", str(e).splitlines()[0][:80])
    mine = t.ones(3, device="cuda") * 2
    print("mine", mine.numpy().tolist())
"""


def test_another_clients_ids_reach_nothing_of_it(server, tmp_path):
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    victim = server.client(tmp_path, "victim", ISOLATION_VICTIM, ready, go)
    deadline = time.monotonic() + 120
    while not os.path.exists(ready):
        assert victim.poll() is None and time.monotonic() < deadline, victim.communicate()
        time.sleep(0.1)
    out = finish(server.client(tmp_path, "attacker", ISOLATION_ATTACKER, ready))
    assert "read " not in out.replace("refused read", ""), out
    guesses = int(out.split("guesses ")[1].split()[0])
    assert guesses >= 4 and out.count("refused read") == guesses, out
    assert "mine [2.0, 2.0, 2.0]" in out, out
    open(go, "w").close()
    assert "secret [0.0, 10.0, 20.0, 30.0]" in finish(victim)


KEEPER = """
    import sys, time
    import gtmpi as t
    big = t.ones(2_000_000, device="cuda")  # 8 MB on a worker
    print("ready", float(big[0]), flush=True)
    time.sleep(600)
"""


UNTAKEN = """
    import sys, time
    import gtmpi as t
    from gtmpi.client.runtime import runtime
    big = t.ones(2_000_000, device="cuda")  # 8 MB: it leaves the worker only as the client takes it
    print("ready", float(big[0]), flush=True)
    d = runtime().dispatcher
    d.links[1].send([("read", None, (big.id,), 0, None)], 99)  # a read nobody receives
    d.rounds.end()
    print("sent", flush=True)
    time.sleep(600)
"""


@pytest.mark.timeout(300)
def test_a_read_its_client_never_takes_holds_no_worker(server, tmp_path):
    from gtmpi.server import TAKES_S
    # killed while the server sends it a read: its connection's end drops it at once
    untaken = server.client(tmp_path, "untaken", UNTAKEN)
    assert untaken.stdout.readline().strip() == "ready 1.0"
    assert untaken.stdout.readline().strip() == "sent"
    time.sleep(0.5)
    start = time.monotonic()
    os.killpg(untaken.pid, signal.SIGKILL)
    untaken.wait(30)
    while "(untaken.py, pid" not in server.text():
        assert time.monotonic() - start < TAKES_S / 2, server.text()
        time.sleep(0.1)
    assert "gone (its connection ended); its tensors are freed" in server.text()
    assert "reads 4800.0" in finish(server.client(tmp_path, "reads", READS, "1"))
    # alive, but never taking it: dropped once the read's deadline passes, the others served
    stuck = server.client(tmp_path, "stuck", UNTAKEN)
    assert stuck.stdout.readline().strip() == "ready 1.0"
    other = server.client(tmp_path, "reads2", READS, "2")
    assert "reads 9600.0" in finish(other)
    while "did not take a read" not in server.text():
        assert stuck.poll() is None and time.monotonic() - start < 120, server.text()
        time.sleep(0.2)
    assert "(stuck.py, pid" in server.text() and "the server has dropped the client" in server.text()
    os.killpg(stuck.pid, signal.SIGKILL)
    stuck.wait(30)


@pytest.mark.timeout(300)
def test_a_killed_client_is_freed_and_the_others_carry_on(server, tmp_path):
    keeper = server.client(tmp_path, "keeper", KEEPER)
    assert keeper.stdout.readline().strip() == "ready 1.0"
    other = server.client(tmp_path, "reads", READS, "3")
    held = server.snapshot()
    slot = [c for c in held["clients"] if c["name"] == "keeper.py"][0]["slot"]
    assert sum(w["slots"].get(str(slot), {}).get("held_bytes", 0)
               for w in held["workers"].values()) >= 8e6, held
    start = time.monotonic()
    os.killpg(keeper.pid, signal.SIGKILL)
    keeper.wait(30)
    while f"client {slot} (keeper.py" not in server.text():
        assert time.monotonic() - start < 10, "not seen dead within 10 s: " + server.text()
        time.sleep(0.1)
    assert f"client {slot} (keeper.py, pid" in server.text() and "gone" in server.text()
    assert "reads 14400.0" in finish(other)
    after = server.snapshot()
    assert all(str(slot) not in w["slots"] for w in after["workers"].values())
    assert "mine" not in server.text()
    # and a new client is served
    assert "reads 9600.0" in finish(server.client(tmp_path, "reads2", READS, "2"))


UPLOADER = """
    import numpy as np
    import gtmpi as t
    a = np.random.default_rng(0).standard_normal(8_000_000).astype(np.float32)
    print("ready", flush=True)
    keep = []
    for i in range(1000):  # 32 MB uploads, one after another
        keep.append(t.tensor(a, device="cuda"))
        if len(keep) > 4:
            keep.pop(0)
"""


def test_clients_killed_while_uploading_harm_neither_the_server_nor_the_next(server, tmp_path):
    """kill -9 of a client at a random moment of its stream of 32 MB uploads: the server's rank
    0 once died reading the dead client's memory in place (UCX's cross-memory attach, when
    clients joined the server's MPI job), and then waited forever for the rest of an upload
    that was never coming. Each time, a client after it is served.
    GTMPI_UPLOAD_KILL_TRIALS sets the number of kills (3 by default; 20 of 20 measured)."""
    import random
    rng = random.Random(0)
    for trial in range(int(os.environ.get("GTMPI_UPLOAD_KILL_TRIALS", "3"))):
        uploader = server.client(tmp_path, f"up{trial}", UPLOADER)
        assert uploader.stdout.readline().strip() == "ready", server.text()
        time.sleep(rng.uniform(0.05, 1.5))
        os.killpg(uploader.pid, signal.SIGKILL)
        uploader.wait(30)
        assert server.proc.poll() is None, server.text()
        assert "reads 9600.0" in finish(server.client(tmp_path, f"reads{trial}", READS, "2"), 60)


def test_a_client_over_its_quota_gets_a_memory_error_and_keeps_the_rest(tmp_path):
    s = Server(tmp_path, "--quota-gb", "0.004")
    try:
        out = finish(s.client(tmp_path, "greedy", """
            import gtmpi as t
            small = t.ones(1000, device="cuda") * 3
            try:
                big = t.ones(2_000_000, device="cuda") + 1   # 8 MB of each: over 4 MB
                print(float(big[0]))
            except t.WorkerError as e:
                print("refused:", "MemoryError" in str(e), "quota" in str(e))
            print("small", float(small.sum()))
            del big
            mine = t.debug.worker_stats()[1]  # this client's figures, not the server's
            print("held", mine["memory_bytes"], mine["tensors"])
        """))
    finally:
        s.stop()
    assert "refused: True True" in out and "small 3000.0" in out, out
    held = int(out.split("held ")[1].split()[0])
    assert 4000 <= held < 4100, out  # small's 1,000 floats (and a scalar): the 8 MB are gone


def test_sigterm_ends_the_server_and_tells_its_clients(tmp_path):
    s = Server(tmp_path)
    waiting = s.client(tmp_path, "waiting", """
        import time
        import gtmpi as t
        x = t.ones(4, device="cuda")
        print("ready", flush=True)
        try:
            while True:
                x = x + 1
                x.numpy()
                time.sleep(0.05)
        except RuntimeError as e:
            print("told:", e)
    """)
    assert waiting.stdout.readline().strip() == "ready"
    os.kill(s.proc.pid, signal.SIGTERM)  # timeout passes it to mpiexec, which passes it on
    out = finish(waiting, 60)
    assert "told: the gtmpi server" in out and "shutting down: SIGTERM" in out, out
    s.proc.wait(60)
    assert "shutting down (SIGTERM)" in s.stop()


LOAD = """
    import sys
    import gtmpi as t
    k = int(sys.argv[1])
    x = t.full((8,), float(k), device="cuda")
    for i in range(1, 5001):
        x = x + k
        if i % 500 == 0:
            got = float(x[k % 8])
            assert got == (i + 1) * k, (k, i, got)
    print("ok", k, float(x.sum()))
"""


@pytest.mark.timeout(600)
def test_eight_clients_of_five_thousand_ops_each(server, tmp_path):
    before = server.snapshot()
    procs = [server.client(tmp_path, f"load{k}", LOAD, str(k)) for k in range(1, 9)]
    for k, p in enumerate(procs, 1):
        assert f"ok {k} {8.0 * 5001 * k}" in finish(p, 500)
    time.sleep(1)
    after = server.snapshot()
    assert not after["clients"]
    assert {c["name"] for c in after["left"]} >= {f"load{k}.py" for k in range(1, 9)}
    for rank, w in after["workers"].items():
        assert set(w["slots"]) == {"0"}, w["slots"]  # every client's executor is gone
        assert w["slots"]["0"]["tensors"] == before["workers"][rank]["slots"]["0"]["tensors"]


def test_the_monitor_shows_a_running_train_py_and_leaves_its_losses_alone(tmp_path):
    port = str(tmp_path / "run.port")
    cmd = ["timeout", "200", MPIEXEC, "-n", "3", sys.executable,
           os.path.join(ROOT, "examples", "gpt", "train.py"), "--size", "tiny", "--steps", "80"]
    env = _env(GTMPI_CONFIG=os.path.join(ROOT, "configs", "data_parallel.yaml"),
               GTMPI_MONITOR_INTERVAL_S="0.2")  # frames five times a second: a short run
    plain = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=220)
    assert plain.returncode == 0, plain.stderr
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**env, "GTMPI_MONITOR": port}, start_new_session=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(port):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.1)
    # gtmpi-trace top's own loop, attached from here: a top of its own would start no sooner
    # than its torch import, by when a GPU host has run the whole job. Frames for 5 s, or
    # until the job ends (a GPU host's run is shorter): some while it trains
    from gtmpi.monitor.top import watch
    shown = io.StringIO()
    assert watch(port, frames=25, out=shown) == 0
    top = shown.getvalue()
    out, err = run.communicate(timeout=220)
    assert run.returncode == 0, err
    frame = top.strip().split("\n\n")[-2:]
    rows = [line.split() for line in top.splitlines() if line.strip()[:1].isdigit()]
    assert {r[0] for r in rows} == {"1", "2"}, top
    rates = [(int(r[2].replace(",", "")), int(r[4].replace(",", ""))) for r in rows
             if r[2] != "-" and r[4] != "-"]  # "-": no second push of that worker yet
    assert any(ops > 0 and reduces > 0 for ops, reduces in rates), \
        top  # instructions and all-reduces per second while it trains
    assert frame and _gpt_losses(out) == _gpt_losses(plain.stdout)
    assert not os.path.exists(port)  # the run took its port file with it


BAD_INDEX = """
    import gtmpi as t
    emb = t.nn.Embedding(10, 4)
    try:
        print(emb(t.tensor([1, 12, 3])).sum().item())
    except t.WorkerError as e:
        print("told:", e)
"""


def test_a_bad_index_fails_its_client_only(server, tmp_path):
    # on GPU workers an index out of range would be a device-side assert, ending the worker
    # for every client: the worker checks a client's indices on the device (worker/bounds.py)
    other = server.client(tmp_path, "reads", READS, "4")
    out = finish(server.client(tmp_path, "badindex", BAD_INDEX))
    assert "told:" in out and "IndexError" in out, out
    assert "reads 19200.0" in finish(other)
    assert "reads 4800.0" in finish(server.client(tmp_path, "reads1", READS, "1"))


def test_a_batch_that_is_not_gtmpis_drops_its_client_not_the_server(server, tmp_path):
    out = finish(server.client(tmp_path, "hostile", """
        import gtmpi as t
        from gtmpi.client.runtime import runtime
        x = t.ones(3, device="cuda")
        print("before", x.numpy().tolist(), flush=True)
        d = runtime().dispatcher
        d.links[1].send([("no such instruction",)], 99)  # not a 5-tuple: no op can run it
        d.rounds.end()
        try:
            (x + 1).numpy()
        except RuntimeError as e:
            print("told:", e)
    """))
    assert "before [1.0, 1.0, 1.0]" in out and "could not run a batch of this client" in out, out
    assert "reads 4800.0" in finish(server.client(tmp_path, "reads", READS, "1"))
    assert "dropped the client" in server.text()


HOSTILE = """
    import os, pickle, sys
    from mpi4py import MPI
    import gtmpi as t
    from gtmpi.client.runtime import runtime
    from gtmpi.transport.tags import Tag
    x = t.ones(3, device="cuda")
    print("before", x.numpy().tolist(), flush=True)
    d = runtime().dispatcher
    link = d.links[1]

    class Runs:  # unpickled, it would run a command as the worker's process
        def __reduce__(self):
            return (os.system, (f"touch {sys.argv[2]}",))
    case = sys.argv[1]
    if case == "code":  # a pickle, as a batch once was
        batch = pickle.dumps([("add", 7, (Runs(),), 0, None)])
        link.comms.ctrl.Send([bytearray(batch), MPI.BYTE], link.peer, Tag.BATCH + link._o)
    elif case == "garbage":
        link.comms.ctrl.Send([bytearray(b"not a pickle at all"), MPI.BYTE], link.peer,
                             Tag.BATCH + link._o)
    elif case == "server word":  # a client may not lift its own quota
        link.send([("serving", None, (None,), 0, None)], 99)
    elif case == "round":  # the server's own count of a round's uploads, as code
        link.comms.ctrl.Send([bytearray(pickle.dumps(Runs())), MPI.BYTE], 0, Tag.ROUND)
    elif case == "upload never sent":  # the worker would wait for its bytes for good
        import torch
        link.send([("upload", 7, ((4,), torch.float32), 0, None)], 99)
    elif case == "huge upload":  # 4 PB declared: the worker would wait and grow for good
        import torch
        link.send([("upload", 7, ((1 << 50,), torch.float32), 0, None)], 99)
    elif case == "file":  # a path on the server's host: another user's checkpoint, read
        link.send([("load_piece_", None, (x.id, (("/etc/passwd", "k", (0,)),), ((0, 3),), 1), 1,
                    None)], 99)
    elif case == "program":  # a server-only word inside a program, run by its replay
        link.send([("program", None, (77, [("monitor", None, (), 0, None)]), 0, None),
                   ("replay", None, (77, (), (), "plain", None), 0, None)], 99)
    elif case == "oversized":  # 80 MB as one batch: the server would hold it all
        link.comms.ctrl.Isend([bytearray(80 << 20), MPI.BYTE], link.peer, Tag.BATCH + link._o)
    elif case == "torn":  # a frame that says 1,000 bytes and stops after 10
        from gtmpi.transport.frames import HEADER
        d.rounds.chan.sock.sendall(HEADER.pack(0, Tag.BATCH + link._o, 1000) + bytes(10))
    elif case == "not frames":  # bytes on the connection that are no frame at all
        d.rounds.chan.sock.sendall(bytes(range(256)) * 16)
    elif case == "crossed groups":  # each worker sent the sum in a group of its own: each
        import torch  # would wait in it for the other for good
        t.load_config({"second": {"shard": {"workers": [1]}}})
        y = t.signal.tensor(torch.ones(3), "second")
        y.numpy()
        d.post("dist_init", ("gloo",), [1, 2])
        for gid in (5, 6):
            d.post("new_group", (gid, (1, 2)), [1, 2])
        like = {"shape": (3,), "dtype": torch.float32}
        link.send([("all_reduce", 8, (x.id,), 1, {**like, "group": 5})], 99)
        d.links[2].send([("all_reduce", 8, (y.id,), 1, {**like, "group": 6})], 99)
    elif case in ("lone collective", "lone receive"):  # a partner never sent its part would
        import torch  # wait for it for good, and every client's work on that worker behind it
        d.post("dist_init", ("gloo",), [1, 2])
        like = {"shape": (3,), "dtype": torch.float32}
        if case == "lone collective":
            link.send([("all_reduce", 8, (x.id,), 1, {**like, "group": 0})], 99)
        else:
            d.links[2].send([("recv", 8, (), 0, {**like, "src": 1})], 99)
    d.rounds.end()
    try:
        (x + 1).numpy()
        t.synchronize()  # every worker: the lone receive's is worker 2, which x is not on
    except RuntimeError as e:
        print("told:", e)
"""


HOSTILE_CASES = {
    "code": "not a message of gtmpi's: a value of kind",
    "garbage": "not a message of gtmpi's", "server word": "named 'serving'",
    "file": "named 'load_piece_'", "program": "named 'monitor'",
    "huge upload": "an upload of 4,503,599,627,370,496 bytes, over the",
    "round": "a round whose payload is not its count of uploads",
    # the server relays an upload's bytes before its round: a worker waits a second for them
    "upload never sent": "an upload its client counted did not come within 1 s",
    "oversized": "a message of 83,886,080 bytes, over its limit of 67,108,864",
    "torn": f"a message that stopped arriving (nothing more of it for {TIMEOUT_S} s)",
    "not frames": "bytes, over its limit of",
    "lone collective": "worker rank 1 waits at all_reduce(3, 'torch.float32'), which worker "
                       "rank 2 was never sent",
    "lone receive": "worker rank 2 waits at send((3,), 'torch.float32'), which worker rank 1 "
                    "was never sent",
    "crossed groups": "its workers were sent crossed collectives: worker rank "}
# a lone collective's partner may still be busy with the client's own earlier work (its data
# plane's start, met by both) when the grace passes: then the waiting member's backstop drops
# the client, which says so (seen on a busy 2-core machine)
CROSSED = "each waiting in another of its collectives or transfers"


def test_a_client_cannot_have_the_workers_write_or_read_files(server, tmp_path):
    out = finish(server.client(tmp_path, "sharded", f"""
        import gtmpi as t
        x = t.ones(3, device="cuda")
        for call in (lambda: t.save_sharded({{"x": x}}, {str(tmp_path / "ck")!r}),
                     lambda: t.load_sharded({{"x": x}}, "/etc")):
            try:
                call()
            except RuntimeError as e:
                print("told:", e)
        print("after", x.numpy().tolist())
    """))
    assert out.count("do not touch files on their hosts for a client") == 2, out
    assert "after [1.0, 1.0, 1.0]" in out and not (tmp_path / "ck").exists()


def test_what_a_client_says_of_itself_is_one_line_of_the_servers_log():
    from gtmpi.server import Client
    c = Client(1, None, {"name": "train.py\ngtmpi.server: client 2 (x): forged", "pid": "7\n",
                         "host": "h\x1b[2J"})
    assert c.name == "train.py\\ngtmpi.server: client 2 (x): forged" and c.pid is None
    assert c.host == "h\\x1b[2J"


@pytest.mark.timeout(300)
def test_hostile_clients_messages_run_nothing_and_drop_them_alone(server, tmp_path):
    """A message whose pickle calls a function as it loads, bytes that are no pickle, a control
    word only the server sends, an op that names a file on the server's host, a program that
    holds a word only the server sends, an upload larger than a worker may hold, a round count that is code, an upload whose bytes never
    come,
    a batch too large to take in, a message cut short, bytes on the connection that are no
    message, a collective or a receive sent to one of its two workers only, a collective sent to
    each in another group, all sent at once by
    as many clients: nothing of it runs, on a worker or on the server, and nothing waits for
    good; each client is told why it was dropped; a client working beside them finishes right,
    and a new one joins after."""
    bystander = server.client(tmp_path, "reads", READS, "2")
    hostile = {case: server.client(tmp_path, f"hostile{n}", HOSTILE, case, str(tmp_path / f"ran{n}"))
               for n, case in enumerate(HOSTILE_CASES)}
    for n, (case, proc) in enumerate(hostile.items()):
        out = finish(proc)
        assert "before [1.0, 1.0, 1.0]" in out and "told:" in out, (case, out)
        told = HOSTILE_CASES[case] in out or (case.startswith("lone") and CROSSED in out)
        assert told and "dropped the client" in out, (case, out)
        assert not (tmp_path / f"ran{n}").exists(), case
    assert "reads 9600.0" in finish(bystander)
    assert "reads 4800.0" in finish(server.client(tmp_path, "late", READS, "1"))


FUZZ = """
    import pickle, random, sys, time
    from mpi4py import MPI
    import gtmpi as t
    from gtmpi.client.runtime import runtime
    from gtmpi.transport import wire
    from gtmpi.transport.tags import SLOT_STRIDE, Tag
    rng = random.Random(int(sys.argv[1]))
    x = t.ones(3, device="cuda")
    x.numpy()
    d = runtime().dispatcher
    comm = d.links[1].comms.ctrl
    valid = wire.dumps([("add", 9, (1, 1.0), 1, None), ("read", None, (9,), 1, None)])

    def payload() -> bytes:
        kind = rng.randrange(4)
        if kind == 0:
            return rng.randbytes(rng.randrange(2000))
        if kind == 1:  # a batch of gtmpi's with some bytes changed
            b = bytearray(valid)
            for _ in range(rng.randrange(1, 6)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            return bytes(b)
        if kind == 2:  # well-formed messages of what no dispatcher sends, and a pickle
            encode = pickle.dumps if rng.random() < 0.2 else wire.dumps
            return encode(rng.choice([None, -1, 2 ** 70, "BATCH", [()], [("add",) * 5],
                                      [("zeros", -5, ((10 ** 12,),), 1 << 40, {1: 2})],
                                      {"rank": 1}, [[[[]]]] * 100]))
        return wire.dumps([(rng.choice(["upload", "read", "free", "serving", "program",
                                          "agree", "nope", "add"]), rng.randrange(-5, 50),
                              tuple(rng.randrange(-3, 50) for _ in range(rng.randrange(4))),
                              rng.randrange(8), None)])
    tags = [int(tag) for tag in Tag] + [0, 99, SLOT_STRIDE - 1]
    n = int(sys.argv[2])
    for i in range(n):
        tag = rng.choice(tags)
        # four in five first: known tags, where such a message may go (the workers, for what
        # goes on to them) and rounds that count right, so that they are taken in and reach
        # the workers, not refused at the server's door; then anything
        door = i < n * 4 // 5
        if i == n * 4 // 5 and rng.random() < 0.5:
            time.sleep(1.0)  # the workers' word on what they were sent, before the rest
        if door:
            tag = rng.choice([Tag.BATCH, Tag.UPLOAD, Tag.CLOCK_PING, Tag.ROUND])
        rank = rng.choice([1, 2] if tag in (Tag.BATCH, Tag.UPLOAD, Tag.CLOCK_PING) else [0]) \
            if door else rng.choice([0, 1, 2, 7])
        body = wire.dumps(0) if tag == Tag.ROUND and door else payload()
        comm.Send([bytearray(body), MPI.BYTE], 0, tag + SLOT_STRIDE * rank)
    try:
        (x + 1).numpy()
        print("fuzz: not dropped")
    except RuntimeError as e:
        print("fuzz: told:", e)
"""


def test_a_fuzzing_client_neither_ends_nor_stalls_the_server(server, tmp_path):
    """1,000 random and mutated messages, from four clients in turn: four in five on the tags
    that reach the workers, then on any tag (each client is dropped at the first message that
    is not gtmpi's, by a worker or the server, and told; what it sent after is drained into
    nothing, never unpickled: that once ended the server). A bystander working all along
    finishes right, a new client joins after, and the server (the hostile cases' too) logs no
    traceback. GTMPI_TEST_FUZZ_CLIENTS=20 sends 5,000 (a longer run than the suite's)."""
    bystander = server.client(tmp_path, "reads", READS, "2")
    # another reads all through the fuzz, each answer timed: none waits a second
    done = tmp_path / "fuzz.done"
    waiting = server.client(tmp_path, "waiting", BYSTANDER, str(done))
    for seed in range(int(os.environ.get("GTMPI_TEST_FUZZ_CLIENTS", "4"))):
        out = finish(server.client(tmp_path, f"fuzz{seed}", FUZZ, str(seed), "250"))
        assert "fuzz: told:" in out and "dropped the client" in out, out
    done.write_text("")
    assert "reads 9600.0" in finish(bystander)
    reads, slowest = map(float, finish(waiting).split()[1::2])
    assert reads >= 50 and slowest < 1.0, (reads, slowest)
    assert "reads 4800.0" in finish(server.client(tmp_path, "late", READS, "1"))
    assert "Traceback" not in server.text(), server.text()[-3000:]


UPLOADS = """
    import sys
    import numpy as np
    import gtmpi as t
    k = int(sys.argv[1])
    for i in range(20):
        x = t.from_numpy(np.full(1 << 20, float(i), np.float32))  # 4 MB, through the server
        y = (x * k).numpy()  # from the worker straight to this client
        assert y.shape == (1 << 20,) and y[0] == y[-1] == i * k, (i, y[0], y[-1])
    print("uploads", float(y.sum()))
"""


def test_a_server_trace_has_a_lane_per_client(tmp_path):
    path = str(tmp_path / "server.h5")
    s = Server(tmp_path, "--trace", path)
    try:
        procs = [s.client(tmp_path, "reads2", READS, "2"),
                 s.client(tmp_path, "uploads3", UPLOADS, "3")]
        outs = [finish(p) for p in procs]
    finally:
        log = s.stop()
    assert "reads 9600.0" in outs[0] and f"uploads {57.0 * (1 << 20)}" in outs[1], outs
    assert f"trace written to {path}" in log, log
    from gtmpi.recording import fileformat
    from gtmpi.recording.events import Kind, Lane
    trace = fileformat.read(path)
    clients = {r: info for r, info in trace.ranks.items() if info.get("role") == "client"}
    assert trace.ranks[0]["role"] == "server"
    assert sorted(info["name"] for info in clients.values()) == ["reads2.py", "uploads3.py"]
    for rank, info in clients.items():
        events = trace.events[rank]
        assert (events["lane"] == Lane.CLIENT).all()
        names = [trace.name(n) for n in events["name"]]
        assert any(n.startswith("client ") for n in names)  # its connection, joined to left
        rounds = events[events["kind"] == Kind.WAIT]
        assert (rounds["t1"] >= rounds["t0"]).all()
        moved = events[events["kind"] == Kind.TRANSFER]
        if info["name"] == "reads2.py":
            assert len(rounds) >= 300 and len(moved) == 0  # a read per round, none relayed
        else:  # every upload relayed whole, no read
            assert [trace.name(n) for n in moved["name"]] == ["upload"] * 20
            assert (moved["bytes"] == 4 << 20).all()
    forwarded = trace.events[0][trace.events[0]["kind"] == Kind.SEND]
    assert set(forwarded["peer"]) == set(clients)
    summary = subprocess.run([sys.executable, "-m", "gtmpi.cli", "summary", path],
                             capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0, summary.stderr
    assert summary.stdout.count(" client ") >= 2 and " dispatcher " in summary.stdout
    png = str(tmp_path / "server.png")
    drawn = subprocess.run([sys.executable, "-m", "gtmpi.cli", "timeline", path, "-o", png],
                           capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0 and os.path.getsize(png) > 0, drawn.stderr


def test_a_server_started_without_mpiexec_says_how_to_start(tmp_path):
    env = {k: v for k, v in _env().items() if k not in LAUNCHER_ENV}
    port = str(tmp_path / "x.port")
    server = subprocess.run([sys.executable, "-m", "gtmpi.server", "--port-file", port],
                            capture_output=True, text=True, env=env, timeout=120)
    assert server.returncode == 1 and "mpiexec -n 3 python -m gtmpi.server" in server.stderr
    assert not os.path.exists(port)
    client = subprocess.run([sys.executable, "-c", "import gtmpi; gtmpi.zeros(1).numpy()"],
                            capture_output=True, text=True, env={**env, "GTMPI_CONNECT": port},
                            timeout=120)
    assert client.returncode == 1 and f"no port file at {port}" in client.stderr


def _refused_by(address: tuple[str, int], data: bytes, limit_s: float = 15) -> bytes:
    """Send ``data`` raw and return what comes back before the listener closes the
    connection (bounded)."""
    import socket
    sock = socket.create_connection(address, timeout=limit_s)
    try:
        sock.sendall(data)
        got, deadline = b"", time.monotonic() + limit_s
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                return got
            got += chunk
        raise AssertionError(f"still connected after {limit_s} s: {data[:40]!r}")
    finally:
        sock.close()


def test_the_listener_drops_what_is_not_a_token_and_survives_a_failed_accept(tmp_path,
                                                                            monkeypatch, capsys):
    """The hub (a run's or a server's listener, in a thread of rank 0): bytes that are not
    JSON, a JSON line that is not a hello, a wrong token, an oversized line, silence, and a
    pusher's figures that are not figures each drop their connection only; an accept that
    fails (no file descriptor left) is said once, and later peers are served."""
    import errno
    from gtmpi.monitor import hub as hubs
    from gtmpi.transport.rendezvous import LINE_MAX, dial, read_port_file
    monkeypatch.setattr(hubs, "HELLO_S", 0.5)
    hub = hubs.Hub(str(tmp_path / "run.port"), "run", workers=0)
    try:
        info = read_port_file(str(tmp_path / "run.port"))
        address = (info["host"], info["port"])
        assert info["host"] == "127.0.0.1"  # the loopback unless told otherwise
        for data in (b"\x00\xff\xfe not json\n", b"[1, 2]\n", b'{"token": 5, "role": "stop"}\n',
                     b'{"token": "' + b"0" * 48 + b'", "role": "monitor"}\n',
                     b"x" * (LINE_MAX + 10), b""):
            _refused_by(address, data)
        for figures in ({"rank": "one"}, [1, 2], {"time": 1.0}):
            pusher = dial(info, {"role": "worker", "rank": 1})
            pusher.send(figures)
            assert pusher.recv(timeout_s=15) is None and pusher.closed
        assert hub.refused == 6 + 3 and hub.workers == {}

        class NoDescriptors:  # the listener, out of file descriptors for one accept
            def __init__(self, sock):
                self.sock, self.failed = sock, False

            def accept(self):
                if not self.failed:
                    self.failed = True
                    raise OSError(errno.EMFILE, "Too many open files")
                return self.sock.accept()

            def close(self):
                self.sock.close()
        hub._listener = NoDescriptors(hub._listener)
        monitor = dial(info, {"role": "monitor"})
        snap = monitor.recv(timeout_s=15)
        monitor.close()
        assert snap["kind"] == "run" and hub._listener.failed
        assert capsys.readouterr().err.count("cannot accept a connection now") == 1
    finally:
        hub.close()


def test_garbage_on_a_servers_port_harms_no_client(server, tmp_path):
    """Bytes from any local process, with or without a token's place, leave the server taking
    and serving clients (a non-JSON line once ended its listener thread for good)."""
    info = json.loads(open(server.port_file).read())
    for data in (b"\x00" * 20 + b"\n", b"GET / HTTP/1.0\r\n\r\n", b'{"role": "stop"}\n'):
        answer = _refused_by((info["host"], info["port"]), data)
        assert b"stopping" not in answer
    out = finish(server.client(tmp_path, "reads", READS, "3"))
    assert "reads 14400.0" in out
