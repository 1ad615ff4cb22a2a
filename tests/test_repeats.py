"""Repeated runs replayed without gtmpi.replayable (dispatcher/repeats.py): an unchanged
training loop gives the losses and weights it gives as written, bit for bit, while most of its
instructions reach the worker as replays (graphs through the CPU stand-in); whatever differs
between iterations runs as written, and says so.

Each case runs in a job of its own (plain python, or mpiexec with one worker): repeated runs
are one worker's, and a session whose tensors were ever placed on several (this suite's
sharding tests) sends every instruction through the placer."""
from __future__ import annotations

import json
import os

import pytest

from conftest import UNDER_MPI, mpiexec, run_job

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="starts its own jobs; run from the serial suite")


@pytest.fixture(autouse=True)
def _runs_not_calls(monkeypatch):
    """These count the dispatcher's repeated runs: the model's calls are not captured above
    them (GTMPI_CAPTURE=1 replays a call before its runs are seen)."""
    monkeypatch.setenv("GTMPI_CAPTURE", "0")

TESTS = os.path.dirname(os.path.abspath(__file__))
LOOP = """
import json, sys
import numpy as np
import torch
sys.path.insert(0, {tests!r})
import gtmpi
from gtmpi.client.runtime import runtime
from test_torch_port import load

G = load("gpt_torch_style_repeats", True)


def train(iters=8, accumulate=2, set_to_none=True, dropout=0.0, batch_at=None, swap_at=None):
    # nanoGPT's loop in small: batches sliced from a token array and uploaded, gradient
    # accumulation, clipping, AdamW with a schedule, zero_grad, loss.item()
    gtmpi.manual_seed(0)
    model = G.GPT(G.GPTConfig(dropout=dropout)).to("cuda")
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    data = np.random.default_rng(0).integers(0, 64, 20_000)
    rng = np.random.default_rng(1)
    losses = []
    for it in range(iters):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * (it + 1) / iters  # a schedule: the step's constants change
        batch = {{int(k): v for k, v in (batch_at or {{}}).items()}}.get(it, 4)
        for _ in range(accumulate):
            ix = rng.integers(0, len(data) - 33, batch)
            x = gtmpi.stack([gtmpi.from_numpy(data[i:i + 32]) for i in ix]).to("cuda")
            y = gtmpi.stack([gtmpi.from_numpy(data[i + 1:i + 33]) for i in ix]).to("cuda")
            _, loss = model(x, y)
            (loss / accumulate).backward()
        gtmpi.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if it == swap_at:  # new weight tensors: what was kept reads the old ones
            with gtmpi.no_grad():
                model.transformer.ln_f.weight = gtmpi.nn.Parameter(
                    model.transformer.ln_f.weight * 1.0)
            opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
        losses.append(loss.item())
    return losses, [p.detach().cpu_torch() for p in model.parameters()]


def collectives():
    # collectives the workers ran so far, by kind: [count, bytes] summed over workers
    total = {{}}
    for stats in gtmpi.debug.worker_stats().values():
        for kind, (count, nbytes) in stats["collectives"].items():
            total.setdefault(kind, [0, 0])
            total[kind][0] += count
            total[kind][1] += nbytes
    return total


def since(before, after):
    return {{k: [a - b for a, b in zip(v, before.get(k, [0, 0]))] for k, v in after.items()
            if v != before.get(k, [0, 0])}}


def facts():
    # what the dispatcher says of its repeated runs, and whether explain() says it too
    import io
    out = io.StringIO()
    gtmpi.debug.explain(out)
    report = gtmpi.debug.repeats()
    return {{"report": report, "explained": report in out.getvalue(),
            "programs": runtime().dispatcher.repeats.installed}}


case = json.loads(sys.argv[1])
launched = lambda: sum(s["graph_launches"] for s in gtmpi.debug.worker_stats().values())
if case.pop("replayed_first", False):  # the session's first collectives inside held runs
    replayed = train(**case)
    launches = launched()
    ran_replayed = collectives()
    told = facts()
    gtmpi.debug.auto_replay(False)
    written = train(**case)
    ran_written = since(ran_replayed, collectives())
else:
    gtmpi.debug.auto_replay(False)  # on by default: the loop as written first
    ran = collectives()
    written = train(**case)
    before = launched()
    ran_written = since(ran, ran := collectives())
    gtmpi.debug.auto_replay(True)
    replayed = train(**case)
    launches = launched() - before
    ran_replayed = since(ran, collectives())
    told = facts()
same = written[0] == replayed[0] and all(torch.equal(a, b) for a, b in zip(written[1], replayed[1]))
print("RESULT", json.dumps({{"same": same, "launches": launches,
                            "collectives": [ran_written, ran_replayed], **told}}))
"""


# CPU workers capture through the stand-in; GPU workers (GTMPI_TEST_JOB_DEVICE=auto on a GPU
# machine: tools/gpu-check repeats) capture real CUDA graphs
GRAPHS = {} if os.environ.get("GTMPI_TEST_JOB_DEVICE", "cpu") != "cpu" else \
    {"GTMPI_CUDA_GRAPHS": "emulate"}


def _run(tmp_path, n: int | None = None, env: dict | None = None, **case) -> dict:
    proc, _ = run_job(tmp_path, LOOP.format(tests=TESTS), 240, n=n, args=[json.dumps(case)],
                      env={**GRAPHS, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(line[-1][len("RESULT "):])


def _count(report: str, what: str) -> int:
    if what == "total":
        return int(report.split("of ")[1].split(" instructions")[0].replace(",", ""))
    return int(report.split("instructions, ")[1].split(" replayed")[0].replace(",", ""))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_repeated_loop_gives_the_losses_and_weights_it_gives_as_written(tmp_path, set_to_none):
    got = _run(tmp_path, set_to_none=set_to_none)
    assert got["same"]
    report = got["report"]
    assert _count(report, "replayed") > _count(report, "total") / 2, report  # most went as replays
    assert got["launches"] > 8 and got["explained"]


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec")
def test_under_mpiexec_the_worker_replays_the_same(tmp_path):
    got = _run(tmp_path, n=2, iters=6)
    assert got["same"] and got["launches"] > 4


DP = {"GTMPI_CONFIG": os.path.join(os.path.dirname(TESTS), "configs", "ddp.yaml"),
      "GTMPI_AUTO_REPLAY_PLACED": "1"}


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec")
@pytest.mark.parametrize("case", [{}, {"set_to_none": False}, {"dropout": 0.1},
                                  {"batch_at": {"3": 6}}, {"replayed_first": True}], ids=str)
def test_data_parallel_by_a_config_replays_its_placed_runs(tmp_path, case):
    """Every worker's placed instructions held in runs (GTMPI_AUTO_REPLAY_PLACED=1): the loop
    of two data-parallel workers gives its losses and weights as written, bit for bit, runs
    the same collectives (the buckets of gradients summed during backward), and most of what
    the workers get goes as replays."""
    got = _run(tmp_path, n=3, env=DP, iters=6, **case)
    assert got["same"]
    written, replayed = got["collectives"]
    assert written["all_reduce"][0] > 0 and written == replayed
    report = got["report"]
    assert _count(report, "replayed") > _count(report, "total") / 2, report
    assert got["launches"] > 8
    assert "placing skipped" in report, report
    if "batch_at" in case:  # the run that differs from the one expected is placed after all
        assert "expected wrongly" in report, report


def test_what_differs_between_iterations_runs_as_written_and_is_counted(tmp_path):
    got = _run(tmp_path, batch_at={"5": 3})
    assert got["same"]
    assert "as written: not seen before" in got["report"]
    assert "as written: an upload or an optimizer's step" in got["report"]


def test_runs_with_dropout_replay_the_draws_they_make_as_written(tmp_path):
    """Each run's random ops take the session's next seeds on a replay too (graphs reseed
    their generators per launch): the same masks, bit for bit."""
    got = _run(tmp_path, dropout=0.1)
    assert got["same"]
    report = got["report"]
    assert _count(report, "replayed") > _count(report, "total") / 2, report
    assert got["launches"] > 8


def test_new_weights_make_the_runs_that_read_the_old_ones_go(tmp_path):
    got = _run(tmp_path, iters=10, swap_at=5)
    assert got["same"] and got["programs"] > 0


def test_on_by_default_and_off_by_the_variable(tmp_path):
    import gtmpi
    from gtmpi.client.runtime import runtime
    if os.environ.get("GTMPI_AUTO_REPLAY", "1") != "0":
        assert runtime().dispatcher.repeats is not None and gtmpi.debug.repeats() is not None
    proc, _ = run_job(tmp_path, "import gtmpi\nassert gtmpi.debug.repeats() is None\n"
                      "print('OFF', flush=True)\n", 120, n=None,
                      env={"GTMPI_AUTO_REPLAY": "0"})
    assert proc.returncode == 0 and "OFF" in proc.stdout, proc.stdout + proc.stderr


def test_the_trace_says_which_runs_were_replayed_and_why_others_were_not(tmp_path):
    from gtmpi.recording import fileformat
    from gtmpi.recording.events import Kind, Lane
    path = tmp_path / "run.h5"
    proc, _ = run_job(tmp_path, LOOP.format(tests=TESTS), 240, n=None,
                      args=[json.dumps({"iters": 5})],
                      env={**GRAPHS, "GTMPI_TRACE": str(path)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    trace = fileformat.read(str(path))
    rows = trace.events[0]
    mine = rows[(rows["kind"] == Kind.REPLAY) & (rows["lane"] == Lane.DISPATCHER)]
    fates = {(trace.name(int(e["name"])), trace.name(int(e["detail"]))) for e in mine}
    names = {what for what, _ in fates}
    assert {"replayed", "as written"} <= names, fates
    assert ("as written", "not seen before") in fates
    replayed = mine[[trace.name(int(e["name"])) == "replayed" for e in mine]]
    assert replayed["count"].sum() > 100  # instructions that went out as replays


BAD_BATCH = """
import numpy as np
import torch
import gtmpi
import gtmpi.nn.functional as F

lin = gtmpi.nn.Linear(8, 3)
want = torch.nn.Linear(8, 3)
want.load_state_dict({k: torch.from_numpy(v.detach().numpy()) for k, v in lin.state_dict().items()})
lin = lin.to("cuda")
opt = gtmpi.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
topt = torch.optim.SGD(want.parameters(), lr=0.1, momentum=0.9)
rng = np.random.default_rng(0)
raised = []
for it in range(10):
    x = rng.standard_normal((8, 8)).astype(np.float32)
    y = rng.integers(0, 3, 8)
    if it == 6:
        y[0] = 7  # out of range for 3 classes, in the first worker's half of the batch
    loss = F.cross_entropy(lin(gtmpi.from_numpy(x).to("cuda")), gtmpi.from_numpy(y).to("cuda"))
    loss.backward()
    opt.step()
    opt.zero_grad()
    try:
        loss.item()
    except gtmpi.WorkerError as e:
        raised.append(str(e))
        continue
    topt.zero_grad()
    torch.nn.functional.cross_entropy(want(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    topt.step()
got = torch.from_numpy(lin.weight.detach().numpy())
torch.testing.assert_close(got, want.weight.detach(), rtol=1e-5, atol=1e-6)
print("RAISED", len(raised), "Target 7 is out of bounds" in raised[0], flush=True)
print("REPORT", gtmpi.debug.repeats(), flush=True)
"""


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec")
@pytest.mark.parametrize("ranks,graphs", [(3, "0"), (3, "emulate"), (2, "emulate")])
def test_a_bad_batch_is_skipped_on_every_replica_while_runs_are_replayed(tmp_path, ranks, graphs):
    """A label out of range in a replayed run. Data parallel by the config (3 ranks), placed
    runs held and foreseen: it is in the first worker's half; its gradients fail there, the
    agreement (behind the run that made them, never inside a graph) tells the other worker,
    both skip the step. One worker: the failure inside a launched program (the CPU stand-in of
    a graph) fails the program's outputs, and the worker goes on. Either way the error is
    raised once and the weights are torch's that skipped the batch."""
    if os.environ.get("GTMPI_TEST_JOB_DEVICE", "cpu") != "cpu":
        pytest.skip("a device-side assert on CUDA ends the worker's CUDA context, as it does "
                    "torch's")
    env = {**(DP if ranks == 3 else {}), "GTMPI_CUDA_GRAPHS": graphs}
    proc, _ = run_job(tmp_path, BAD_BATCH, 240, n=ranks, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "RAISED 1 True" in proc.stdout, proc.stdout[-2000:]
    assert ("placing skipped" in proc.stdout) == (ranks == 3), proc.stdout[-2000:]
