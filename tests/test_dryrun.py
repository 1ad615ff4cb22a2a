"""The dry run (GTMPI_DRY_RUN=N, client/dryrun.py): the tiny GPT's training steps against N
simulated workers insert, per worker, the collectives and transfers, with their bytes, that
a real run on N CPU workers (gloo) inserts; its report says so at exit, with memory against
the named GPU; values read are zeros, said once."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import gtmpi
from conftest import mpiexec, run_job

ROOT = Path(__file__).resolve().parent.parent
serial = pytest.mark.skipif(len(gtmpi.info()["workers"]) > 1 or mpiexec() is None,
                            reason="starts its own jobs; run once, from the serial suite")

REPORT = """
    stats = gtmpi.debug.worker_stats()
    print("COLLECTIVES " + json.dumps({r: s["collectives"] for r, s in sorted(stats.items())}))
"""


def gpt(*extra: str) -> str:
    """The tiny GPT's train.py for 3 steps (``extra``: more of its arguments), then its report."""
    return f"""
    import json, sys
    sys.argv = ["train.py", "--size", "tiny", "--steps", "3", "--log-every", "3",
                "--micro-batches", "4", "--dtype", "fp32", "--eval-batches", "1", *{list(extra)!r}]
    sys.path.insert(0, {str(ROOT)!r})
    import gtmpi
    from examples.gpt import train
    train.main()
""" + REPORT


# configs/ddp.yaml is for programs with no signals: tests/train_torch_style.py (nanoGPT's
# train.py, condensed) with its import line switched, as it is otherwise
NANO = f"""
    import json, os, sys, tempfile, types
    import numpy as np
    sys.path.insert(0, {str(ROOT / 'tests')!r})
    import gtmpi
    from test_torch_port import TRAIN, load
    sys.modules["gpt_torch_style"] = load("gpt_torch_style", True)
    source = open(TRAIN).read().replace("import torch\\n", "import gtmpi as torch\\n", 1)
    module = types.ModuleType("train_torch_style")
    exec(compile(source, TRAIN, "exec"), module.__dict__)
    d = tempfile.mkdtemp()
    for split in ("train", "val"):
        np.tile(np.arange(64, dtype=np.uint16), 64).tofile(os.path.join(d, split + ".bin"))
    print("LOSSES " + json.dumps(module.main(d, d, max_iters=3, dtype="float32",
                                             compile=False)["losses"]))
""" + REPORT


# configs/tensor_parallel.yaml is the Megatron MLP's (its signals name no layout of the GPT)
MLP = """
    import json
    import gtmpi
    import gtmpi.nn as nn
    import gtmpi.nn.functional as F
    with gtmpi.signal.context("col"):
        up = nn.Linear(16, 64)
    with gtmpi.signal.context("row"):
        down = nn.Linear(64, 16, bias=False)
    with gtmpi.signal.context("weights"):
        bias = nn.Parameter(gtmpi.zeros(16))
    opt = gtmpi.optim.SGD([*up.parameters(), *down.parameters(), bias], lr=0.1)
    for step in range(3):
        with gtmpi.signal.context("weights"):
            x = gtmpi.randn(8, 16)
        loss = (down(F.gelu(up(x))) + bias).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print("loss", loss.item())
""" + REPORT


def _collectives(proc) -> dict:
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("COLLECTIVES "))
    return {int(r): {k: tuple(v) for k, v in c.items()}
            for r, c in json.loads(line[len("COLLECTIVES "):]).items()}


CONFIGS = ("ddp", "data_parallel", "gpt_tp2", "gpt_tp2_sp", "tensor_parallel", "pipeline", "dp_tp",
           "gpt_tp2_pp2", "gpt_tp2_pp4", "zero1", "zero2", "fsdp")


@pytest.fixture(scope="module")
def alone() -> dict:
    """Each program's run on one worker, by program: made once, by the first test that asks."""
    return {}


def _losses(proc) -> tuple[list[float], float | None]:
    """A run's losses: nanoGPT's loop's LOSSES line, or train.py's report (and its held-out
    loss)."""
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    line = next((l for l in lines if l.startswith("LOSSES ")), None)
    if line is not None:
        return json.loads(line[len("LOSSES "):]), None
    report = json.loads(next(l for l in lines if l.startswith("{")))
    return report["losses"], report["val_loss"]


@serial
@pytest.mark.timeout(300)
@pytest.mark.parametrize("config,workers,extra", [
    ("ddp", 2, "nano"), ("zero2", 2, "nano"), ("fsdp", 2, "nano"),
    ("data_parallel", 2, ()), ("gpt_tp2", 2, ()), ("gpt_tp2_sp", 2, ()),
    ("tensor_parallel", 2, None), ("pipeline", 2, ()), ("dp_tp", 4, ()),
    ("gpt_tp2_pp2", 4, ()), ("gpt_tp2_pp4", 8, ("--layers", "4"))])
def test_a_dry_run_inserts_what_a_real_run_inserts(tmp_path, alone, config, workers, extra):
    """Every config in configs/: the GPT (the MLP for tensor_parallel.yaml, nanoGPT's loop for
    ddp.yaml, zero2.yaml and fsdp.yaml; zero1.yaml differs from zero2.yaml only in the
    gradients' sums). The real run, in strict placement, gives one worker's losses: the
    examples' train.py and nanoGPT's loop, unchanged, under every layout a config makes.
    gpt_tp2_pp4.yaml's real run on 8 workers, with host-held tensors (the default: every
    parameter uploaded to the first stage and sent on from there), is also the case that once
    hung about one run in two: a stage waiting in a gloo send stopped receiving rank 0's
    messages, whose shared-memory cells then kept rank 0's batches from the stage that had the
    receive."""
    assert {p.stem for p in (ROOT / "configs").glob("*.yaml")} == set(CONFIGS)
    program = MLP if extra is None else NANO if extra == "nano" else gpt(*extra)
    env = {"GTMPI_CONFIG": str(ROOT / "configs" / f"{config}.yaml")}
    # strict placement: a batch split by the config is never gathered behind the program's
    # back (nanoGPT's loop: a causal masked_fill, a checkpoint reloaded)
    strict = {"GTMPI_PLACEMENT": "strict"} if extra is not None else {}
    real, _ = run_job(tmp_path, program, 240, n=workers + 1, env={**env, **strict})
    if extra is not None:
        if program not in alone:
            alone[program] = _losses(run_job(tmp_path, program, 240, n=None)[0])
        (losses, val), (want, want_val) = _losses(real), alone[program]
        assert losses == pytest.approx(want, rel=1e-4)
        assert val == want_val if want_val is None else val == pytest.approx(want_val, rel=1e-4)
    dry, _ = run_job(tmp_path, program, 240, n=None,
                     env={**env, "GTMPI_DRY_RUN": str(workers), "GTMPI_DRY_RUN_GPU": "H100"})
    want, got = _collectives(real), _collectives(dry)
    assert got == want
    assert any(want.values())  # the layout inserts something to compare
    if config == "ddp":
        assert not any("all_gather" in c for c in want.values()), want
    if config == "gpt_tp2_pp4":  # the seed's Mini-GPT layout: TP=2 in each of 4 stages
        mode = json.loads(next(l for l in real.stdout.splitlines() if l.startswith("{")))["mode"]
        assert "4 pipeline stages" in mode and "tensor parallel in each" in mode and \
            "blocks per stage 1/1/1/1" in mode, mode
    if config in ("zero2", "fsdp"):  # gradients reduce-scattered into pieces, weights gathered
        assert all({"reduce_scatter", "all_gather"} <= set(c) for c in want.values()), want
    err = dry.stderr
    assert f"gtmpi: dry run: {workers} simulated H100 worker(s)" in err
    assert err.count("a value was read; it is zeros") == 1
    assert f"gtmpi dry run on {workers} simulated H100(s) of 80 GiB" in err
    assert all(f"  worker {r}: " in err for r in range(1, workers + 1))
    assert "DOES NOT FIT" not in err


@serial
def test_a_dry_run_says_what_does_not_fit(tmp_path):
    """8 GiB of weights on a simulated worker: past no GPU's size here, so a bigger tensor."""
    proc, _ = run_job(tmp_path, """
        import gtmpi
        w = gtmpi.zeros(160 * 2 ** 30 // 4)   # 160 GiB of float32: more than an H200 holds
        print((w + 1).sum().item())
    """, 120, n=None, env={"GTMPI_DRY_RUN": "1", "GTMPI_DRY_RUN_GPU": "H200"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0.0"  # a read in a dry run: zeros
    assert "worker 1: " in proc.stderr and "(DOES NOT FIT)" in proc.stderr, proc.stderr
    assert "peak 320.00 GiB" in proc.stderr, proc.stderr  # w and w + 1 held together


@serial
def test_a_dry_runs_peak_counts_what_kernels_make_and_free():
    """The peak is the most bytes alive at once: a kernel's own temporaries count (torch's
    cross-entropy makes log-probabilities as large as the logits inside one instruction and
    frees them before it ends), and tensors freed stop counting."""
    import torch
    from gtmpi.transport.local import LocalLink
    from gtmpi.worker.metaplane import MetaExecutor
    ex = MetaExecutor(1, LocalLink())
    mib, targets = 2 ** 20, 256 * 8
    ex.run([("zeros", 1, ((256, 1024), torch.float32), 0, {}),      # 1 MiB of logits
            ("zeros", 2, ((256,), torch.int64), 0, {})])
    assert ex.meta_peak == mib + targets
    ex.run([("cross_entropy", (3, 5), (1, 2, -100, "mean", 0.0), 3, {})])
    # the log-probabilities while it ran (and the loss, 4 bytes, with its 4-byte sum)
    assert ex.meta_peak == 2 * mib + targets + 8
    assert ex.memory()["memory_bytes"] == mib + targets + 4  # not after: the loss alone
    ex.run([("free", None, (1, 3, 5), 0, None),
            ("zeros", 4, ((256, 1024), torch.float32), 0, {})])
    assert ex.meta_peak == 2 * mib + targets + 8  # 1 died before 4 was made


def test_a_dry_runs_reduce_scatter_keeps_only_its_piece():
    """ZeRO-2's and -3's gradients: the whole partial sum dies once it is reduce-scattered (a
    piece that viewed it kept GPT-3 6.7B's whole gradients counted: 24.3 GiB per worker at
    DP=4, where 4 H200s measured 16.8 GB)."""
    import torch
    from gtmpi.transport.local import LocalLink
    from gtmpi.worker.metaplane import MetaExecutor
    ex = MetaExecutor(1, LocalLink(), workers=2)
    mib = 2 ** 20
    ex.run([("zeros", 1, ((512, 512), torch.float32), 0, {}),  # a whole partial sum: 1 MiB
            ("reduce_scatter", 2, (1,), 1, {"group": 0, "dim": 0, "sizes": (256, 256),
                                             "index": 1, "shape": (512, 512),
                                             "dtype": torch.float32}),
            ("free", None, (1,), 0, None)])
    assert ex.memory()["memory_bytes"] == mib // 2
    assert ex.meta_peak == mib + mib // 2


@serial
def test_a_dry_run_holds_large_host_values_as_meta(tmp_path):
    """Weights made without a device stay with the client until used (client/host.py); in a
    dry run those above HOST_NUMEL are meta, so a model larger than the client's memory
    plans (GPT-3 6.7B's 27 GB of float32 weights stopped a laptop's dry run), and read as
    zeros as every value does; small ones stay values (a batch's token ids, read)."""
    proc, _ = run_job(tmp_path, """
        import resource, gtmpi
        big = gtmpi.nn.Linear(16384, 16384)     # 1 GiB of float32 weights, 40 times
        layers = [gtmpi.nn.Linear(16384, 16384) for _ in range(39)]
        small = gtmpi.arange(6) * 2
        print(big.weight._host.is_meta, small._host.is_meta, small.tolist(),
              big.weight[0, :3].tolist(), (big(gtmpi.ones(2, 16384)).sum()).item(),
              resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 4 * 2 ** 20)
    """, 120, n=None, env={"GTMPI_DRY_RUN": "2"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False", "[0,", "2,", "4,", "6,", "8,", "10]",
                                   "[0.0,", "0.0,", "0.0]", "0.0", "True"], proc.stdout


def test_a_dry_runs_peak_has_cublas_workspaces_and_a_captures_sends():
    """Besides tensors: cuBLAS's workspace from the first matrix product on (one per stream:
    a capture's stream adds one), and a send's snapshot, held while a capture runs."""
    import torch
    from gtmpi.transport.local import LocalLink
    from gtmpi.worker import costmodel
    from gtmpi.worker.metaplane import MetaExecutor
    ex = MetaExecutor(1, LocalLink())
    ws, mib = costmodel.GPUS["H100"].blas_workspace, 2 ** 20
    ex.run([("zeros", 1, ((512, 512), torch.float32), 0, {})])  # 1 MiB
    assert ex.meta_peak == mib
    ex.run([("matmul", 2, (1, 1), 3, None), ("matmul", 3, (2, 2), 3, None)])
    assert ex.meta_peak == 3 * mib + ws  # 1, 2, 3 and one workspace (not one per product)
    alive = ex._made.alive
    with ex._made:
        ex.plane.send(ex.env[1], 2)  # done at once: its snapshot lives only while it is made
        assert ex._made.alive == alive
        ex.plane.holding = True
        ex.plane.send(ex.env[1], 2)
        ex.plane.send(ex.env[1], 2)
        assert ex._made.alive == alive + 2 * mib  # a capture keeps them to its end
        ex.plane.holding = False
        ex.plane.settle_sends()
        assert ex._made.alive == alive


@serial
def test_a_dry_run_skips_replays_it_has_seen_with_the_same_counts(tmp_path):
    """After a program's third replay a dry run makes only what the replay leaves and counts
    what it ran: the same collectives and peak as running every replay (which a trace makes
    it do; the trace's own control words make the instruction counts differ)."""
    program = """
        import gtmpi
        import gtmpi.nn as nn
        import gtmpi.nn.functional as F
        gtmpi.load_config({"data": {"shard": {"axis": 0, "workers": [0, 1]}},
                           "weights": {"shard": {"workers": [0, 1], "replicated": True}}})
        with gtmpi.signal.context("weights"):
            model = nn.Linear(4096, 4096)  # 64 MiB of weights: a peak the report shows
        @gtmpi.replayable
        def step(x):
            loss = F.gelu(model(x)).square().mean()
            loss.backward()
            return loss
        for i in range(STEPS):
            model.zero_grad()
            step(gtmpi.signal.tensor(gtmpi.randn(1024, 4096), "data")).item()
    """
    reports = []
    for steps, env in ((12, {}), (12, {"GTMPI_TRACE": str(tmp_path / "all.h5")})):
        proc, _ = run_job(tmp_path, program.replace("STEPS", str(steps)), 120, n=None,
                          env={"GTMPI_DRY_RUN": "2", **env})
        assert proc.returncode == 0, proc.stderr
        reports.append([line.split(" instructions; ")[1] for line in proc.stderr.splitlines()
                        if line.startswith("  worker")])
    assert reports[0] == reports[1] and len(reports[0]) == 2, reports


@serial
def test_a_dry_runs_skipped_replays_leave_what_attentions_gradient_reads(tmp_path):
    """A replay skipped after the third leaves every result that outlives it, not only
    tensors: attention's record for its gradient is None on meta, and the gradient of the
    forward's replay reads it (nanoGPT's loop failed there with a KeyError)."""
    program = """
        import gtmpi
        import gtmpi.nn as nn
        import gtmpi.nn.functional as F
        # blocks enough for a forward of several runs: records outlive the run that made them
        blocks = nn.ModuleList(nn.ModuleList([nn.Linear(32, 96), nn.Linear(32, 32)])
                               for _ in range(6))
        opt = gtmpi.optim.AdamW(blocks.parameters(), lr=1e-3)
        for i in range(8):
            x = gtmpi.randn(2, 16, 32)
            for qkv, out in blocks:
                q, k, v = qkv(x).split(32, dim=2)
                q, k, v = (t.view(2, 16, 2, 16).transpose(1, 2) for t in (q, k, v))
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + out(y.transpose(1, 2).reshape(2, 16, 32))
            loss = x.square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            print("LOSS", loss.item())
        print(gtmpi.debug.repeats())
    """
    proc, _ = run_job(tmp_path, program, 120, n=None, env={"GTMPI_DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("LOSS 0.0") == 8
    assert "replayed" in proc.stdout


@serial
def test_a_dry_runs_trace_lasts_what_the_cost_model_says(tmp_path):
    """A dry run's workers are stamped with a modeled clock: a float32 matmul of two 4096²
    matrices lasts its arithmetic at the named GPU's share of peak (worker/costmodel.py),
    a view lasts nothing, and gtmpi-trace draws the timeline."""
    import subprocess
    import sys
    import numpy as np
    import torch
    from gtmpi.ops.table import Kind
    from gtmpi.recording import fileformat
    from gtmpi.worker import costmodel
    trace = tmp_path / "modeled.h5"
    proc, _ = run_job(tmp_path, """
        import gtmpi
        a = gtmpi.ones(4096, 4096)
        b = (a @ a).view(-1)
        print(b.sum().item())
    """, 120, n=None, env={"GTMPI_DRY_RUN": "1", "GTMPI_DRY_RUN_GPU": "A100",
                           "GTMPI_TRACE": str(trace)})
    assert proc.returncode == 0, proc.stderr
    t = fileformat.read(str(trace))
    events = t.events[1]
    names = [t.name(int(n)) for n in events["name"]]
    took = {n: int(e["t1"]) - int(e["t0"]) for n, e in zip(names, events) if n in ("matmul", "view")}
    a = torch.empty(4096, 4096, device="meta")
    want = costmodel.instruction_ns("matmul", Kind.MATMUL, [a, a], [a.clone()],
                                    costmodel.GPUS["A100"], 1)
    assert want > 10_000_000  # 2 * 4096**3 flops at 70% of 19.5 TFLOP/s: about 10 ms
    assert abs(took["matmul"] - want) < 1_000, (took, want)
    assert took["view"] == 0
    # a, the product, its sum, and cuBLAS's workspace from the product on
    assert t.ranks[1]["peak_bytes"] == 2 * 4096 * 4096 * 4 + 4 + costmodel.GPUS["A100"].blas_workspace
    drawn = subprocess.run([sys.executable, "-m", "gtmpi.cli", "timeline", str(trace), "-o",
                            str(tmp_path / "t.png")], capture_output=True, text=True, timeout=60)
    assert drawn.returncode == 0 and (tmp_path / "t.png").stat().st_size > 0, drawn.stderr
    assert np.all(events["t1"] >= events["t0"])


@serial
def test_a_dry_run_writes_a_trace_the_trace_tool_reads(tmp_path):
    """The trace's inserted collectives (gtmpi-trace comms) are the dry run's; its durations
    are the simulated workers' host times, not the GPUs'."""
    trace = tmp_path / "dry.h5"
    proc, _ = run_job(tmp_path, gpt(), 240, n=None,
                      env={"GTMPI_CONFIG": str(ROOT / "configs" / "gpt_tp2.yaml"),
                           "GTMPI_DRY_RUN": "2", "GTMPI_TRACE": str(trace)})
    counts = _collectives(proc)
    import subprocess
    import sys
    comms = subprocess.run([sys.executable, "-m", "gtmpi.cli", "comms", str(trace)],
                           capture_output=True, text=True, timeout=60)
    assert comms.returncode == 0, comms.stderr
    rows = [line.split() for line in comms.stdout.splitlines()[1:] if line.strip()]
    traced = sum(int(r[1]) for r in rows if r[2].startswith("all_reduce"))
    # the trace covers the whole run, as the workers' counts do, one per member
    assert traced == sum(c["all_reduce"][0] for c in counts.values()), (comms.stdout, counts)


@serial
def test_dry_run_asked_for_in_the_program(tmp_path):
    proc, _ = run_job(tmp_path, """
        import gtmpi, torch
        gtmpi.dry_run(workers=2, gpu="A100")
        gtmpi.load_config({"data": {"shard": {"axis": 0, "workers": [0, 1]}},
                           "weights": {"shard": {"workers": [0, 1], "replicated": True}}})
        with gtmpi.signal.context("weights"):
            w = gtmpi.ones(8, 4, requires_grad=True)
        x = gtmpi.signal.tensor(torch.ones(6, 8), "data")
        (x @ w).sum().backward()
        stats = gtmpi.debug.worker_stats()
        print(sorted(stats), [s["device"] for _, s in sorted(stats.items())])
        try:
            gtmpi.dry_run(workers=4)
        except RuntimeError as e:
            print("again:", e)
    """, 120, n=None)
    assert proc.returncode == 0, proc.stderr
    assert "[1, 2] ['meta', 'meta']" in proc.stdout
    assert "again: gtmpi.dry_run() must come before the program's first tensor" in proc.stdout
    assert "gtmpi dry run on 2 simulated A100(s) of 80 GiB" in proc.stderr
    assert "all_reduce" in proc.stderr  # the gradient of the replicated weight, summed


@serial
@pytest.mark.parametrize("how", ["mpiexec", "workers(n)"])
def test_a_dry_run_asked_for_under_mpiexec_or_with_workers_n_plans_and_runs_nothing(tmp_path,
                                                                                   how):
    """GTMPI_DRY_RUN kept on an sbatch script's launch line, or a program that starts its own
    workers: the run is planned, never run for real, and train.py prints no zeros as losses
    and no timings of a run that computed nothing."""
    body = gpt() if how == "mpiexec" else "import gtmpi\ngtmpi.workers(2)\n" + \
        textwrap.dedent(gpt())
    proc, _ = run_job(tmp_path, body, 120, n=3 if how == "mpiexec" else None,
                      env={"GTMPI_DRY_RUN": "4"})
    assert proc.returncode == 0, proc.stderr
    said = ("a dry run on rank 0 alone; this job's 2 other rank(s) leave unused"
            if how == "mpiexec" else "gtmpi.workers(2) starts no process; the dry run "
            "simulates 4 worker(s)")
    assert said in proc.stderr, proc.stderr
    assert "gtmpi dry run on 4 simulated H100(s)" in proc.stderr, proc.stderr
    assert "step     3/3  (dry run: no loss, no timing)" in proc.stdout, proc.stdout
    assert "loss 0.0000" not in proc.stdout and "tokens/s" not in proc.stdout
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert result["dry_run"] and result["losses"] == [] and result["tokens_per_s"] is None
    assert result["workers"] == 4
