"""A real program, unchanged: nanoGPT's train.py beside torch's original on this machine.

    python benchmarks/real.py PATH [--iters 40] [--batch 8] [--gpus N] [--runs torch,embedded,...]
    python benchmarks/real.py PATH --config train_shakespeare_char [--iters 500]
    python benchmarks/real.py PATH --sample [--samples 3] [--tokens 300]

PATH is a checkout of karpathy/nanoGPT. In a temporary folder, its train.py, model.py and
configurator.py are copied twice: as they are (torch), and with only their torch import lines
switched to gtmpi (``import torch`` -> ``import gtmpi as torch``, ``import torch.nn as nn`` ->
``import gtmpi.nn as nn``, ``from torch.nn import functional as F`` -> ``from gtmpi.nn import
functional as F``). Two ways to run it:

- by default, a dataset of random GPT-2 tokens stands in for OpenWebText, and each run trains
  GPT-2 small (12 layers, 768 wide, 1024 tokens, bf16 autocast on GPUs, no torch.compile,
  dropout 0, one micro-step per iteration, the loss read every iteration) for --iters
  iterations;
- ``--config NAME``: nanoGPT's own config/NAME.py as its README runs it (for
  train_shakespeare_char: the character-level baby GPT, 6 layers of 384 on 256 characters,
  batch 64, dropout 0.2, the loss read every 10th iteration, 200 evaluation batches of each
  split every 250, a checkpoint when the validation loss improves, torch.compile on), with
  only --max_iters set (and the device on a machine with no GPU). Its dataset is made by the
  checkout's own data/<dataset>/prepare.py, from a generated text where the download would be
  (GPU hosts reach nothing). "torch" runs the config as it is (compiled); "torch-eager" with
  --compile=False; gtmpi's runs as they are (gtmpi.compile(model) compiles under
  GTMPI_COMPILE=asked only: the -asked runs);
- ``--sample``: sample.py as the README runs it after that training (a checkpoint of the same
  model made by two iterations of its train.py), --samples samples of --tokens tokens each;
  its figure is ms per token, the median over the samples after the first (each timed by the
  wall clock at which its printed end arrived). Runs: torch, torch-compiled, embedded,
  mpiexec and their -captured variants, embedded-graphed (captured, and each size of the
  growing sequence a CUDA graph: GTMPI_SIZED_GRAPHS=1), embedded-compiled (captured, and the
  growing program compiled by Inductor for every size: GTMPI_COMPILE=1) (default: torch,
  embedded, embedded-captured, embedded-compiled). A graph per size starts at a size's third
  call, so the samples after the second show it; ms_each lists every sample's.

The runs:

  torch        python train.py (the original), one GPU
  torch-eager  the same with --compile=False (--config only: the default runs are eager)
  embedded     python train.py (gtmpi, the embedded worker), one GPU, the model's calls as
               written (GTMPI_CAPTURE=0; gtmpi's default captures them with one worker)
  mpiexec      mpiexec -n 2 python train.py (gtmpi), one GPU, as written too
  embedded-eager, mpiexec-eager
               the same with GTMPI_AUTO_REPLAY=0 (repeated runs not replayed: no CUDA graphs)
  embedded-captured, mpiexec-captured
               the same with GTMPI_CAPTURE=1 (the model's calls captured: nn/capture.py)
  embedded-compiled, mpiexec-compiled
               captured, and the captured programs compiled by Inductor (GTMPI_COMPILE=1)
  embedded-default, mpiexec-default
               gtmpi's defaults, as a user runs it (GTMPI_CAPTURE unset: captured with one
               worker)
  embedded-asked, mpiexec-asked
               the same with GTMPI_COMPILE=asked and the program's --compile=True: its
               gtmpi.compile(model) has the model's forward and backward compiled where that
               wins, as torch-compiled has torch's (the default runs are eager)
  torch-compiled  the original with --compile=True (the default runs are eager)
  ddp          torchrun --nproc-per-node N train.py (the original's own DDP), N GPUs, batch
               --batch per GPU (gradient_accumulation_steps N: one micro-step each)
  dp-config    GTMPI_CONFIG=configs/ddp.yaml mpiexec -n N+1 python train.py (gtmpi, the
               program unchanged), the same per-GPU batch
  dp-config-replayed
               the same with GTMPI_AUTO_REPLAY_PLACED=1 (every worker's placed runs replayed,
               as CUDA graphs with the gradients' all-reduces inside)

GTMPI_PROFILE=DIR records GPU kernels over optimizer steps FIRST to FIRST+COUNT
(GTMPI_PROFILE_REPLAYS=FIRST:COUNT, default 10:4) for gtmpi.trace.kernels DIR: gtmpi's
workers' (worker/profiler.py), and torch's runs' own into DIR/torch.json.

Figures per run: ms per iteration, the median over windows between two of train.py's log lines
from iteration 10 on with no evaluation inside, by the wall clock at which each line arrived
(a line follows a read of the loss, so the work before it is done; train.py's own "time" is
one iteration's host time, which for an asynchronous runtime need not be the work's when the
loss is read every 10th iteration only); the whole run's wall time (start-up, compilation,
evaluations and checkpoints included) and the evaluations' share of it; tokens/s; the peak GPU
memory (torch.cuda.max_memory_allocated, read by a wrapper after the program returns: the
program is not changed); iteration 0's loss and the last one; with --trace, rank 0's host time
per iteration (the median from the 10th on, gtmpi-trace steps: the time between two of the
optimizer's updates that rank 0 did not spend waiting for its worker). A table, then one JSON
line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWITCH = [(re.compile(r"^import torch$", re.M), "import gtmpi as torch"),
          (re.compile(r"^import torch\.nn as nn$", re.M), "import gtmpi.nn as nn"),
          (re.compile(r"^from torch\.nn import functional as F$", re.M),
           "from gtmpi.nn import functional as F")]
# runs train.py as its own __main__, then reports the peak memory of the first GPU it used
WRAPPER = """
import os, sys, runpy
import {module} as torch
memory = {module!r} == "torch" and torch.cuda.is_available() and \\
    os.environ.get("GTMPI_MEMORY_HISTORY")
if memory:  # gtmpi's workers record their own (worker/profiler.py)
    torch.cuda.memory._record_memory_history(max_entries=4_000_000)
profile = {module!r} == "torch" and torch.cuda.is_available() and \
    os.environ.get("GTMPI_PROFILE")
if profile:  # torch's kernels of the same steps as gtmpi's workers record (worker/profiler.py)
    first, _, count = os.environ.get("GTMPI_PROFILE_REPLAYS", "10:4").partition(":")
    window = {{"steps": 0, "on": None}}

    def _step(optimizer, args, kwargs):
        window["steps"] += 1
        if window["steps"] == int(first):
            torch.cuda.synchronize()
            window["on"] = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA])
            window["on"].__enter__()
        elif window["steps"] == int(first) + int(count or 4) and window["on"] is not None:
            torch.cuda.synchronize()
            window["on"].__exit__(None, None, None)
            os.makedirs(profile, exist_ok=True)
            window["on"].export_chrome_trace(os.path.join(profile, "torch.json"))
            window["on"] = None
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(_step)
script = os.environ.get("REAL_SCRIPT", "train.py")
sys.argv = [script] + sys.argv[1:]
runpy.run_path(script, run_name="__main__")
if memory:
    os.makedirs(memory, exist_ok=True)
    torch.cuda.memory._dump_snapshot(os.path.join(memory, "torch.pickle"))
if torch.cuda.is_available() and {report}:
    print("PEAK_BYTES", torch.cuda.max_memory_allocated(), flush=True)
if hasattr(torch, "debug") and torch.debug.repeats():
    print(torch.debug.repeats(), flush=True)
if hasattr(torch, "debug"):
    keys = ("ops", "control", "batches", "exec_ns", "wait_ns", "graph_launches", "graphed_ops",
            "graph_fallbacks", "graph_fallback_reasons", "graph_input_bytes", "graph_copies",
            "compiles", "compile_refusals", "sized_compiled", "sized_unfit")
    for rank, s in torch.debug.worker_stats().items():
        print("worker", rank, {{k: s.get(k) for k in keys}}, flush=True)
if hasattr(torch, "debug") and os.environ.get("GTMPI_COMPILE", "0") != "0":
    import io
    said = io.StringIO()
    torch.debug.explain(file=said)  # each program's compile time, or why it was not compiled
    for line in said.getvalue().splitlines():
        if "compiled" in line:
            print("compile:", line.strip(), flush=True)
"""
LINE = re.compile(r"^iter (\d+): loss ([0-9.]+), time ([0-9.]+)ms")
EVAL = re.compile(r"^step (\d+): train loss")
RUNS = "torch,embedded,mpiexec,embedded-eager,mpiexec-eager,ddp,dp-config,dp-config-replayed"
TOKENS = re.compile(r"tokens per iteration will be: ([0-9,]+)")


def _text(chars: int = 1_100_000) -> str:
    """A play-like text of about tiny Shakespeare's size, for a prepare.py that would download
    it: words of letters, capitalised lines with punctuation, speakers' names."""
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, rng.integers(1, 9))) for _ in range(3000)]
    speakers = ["ROMEO", "JULIET", "KING HENRY", "First Citizen", "MENENIUS"]
    lines, n = [], 0
    while n < chars:
        line = " ".join(rng.choice(words, rng.integers(3, 13))).capitalize() + \
            str(rng.choice(list(".,;:!?"))) + "\n"
        if rng.random() < 0.1:
            line = str(rng.choice(speakers)) + ":\n" + line
        lines.append(line)
        n += len(line)
    return "".join(lines)


def _dataset(src: str, where: str, config: str | None) -> None:
    """data/<dataset>/ as train.py reads it: made by the checkout's own prepare.py where the
    config names a dataset that has one (its download replaced by a generated text), else
    random GPT-2 tokens standing in for OpenWebText."""
    name = "openwebtext"
    if config:
        said = re.search(r"^dataset\s*=\s*['\"](\w+)['\"]", open(config).read(), re.M)
        name = said.group(1) if said else name
    data = os.path.join(where, "data", name)
    os.makedirs(data)
    script = os.path.join(src, "data", name, "prepare.py")
    if name != "openwebtext" and os.path.exists(script):
        shutil.copy(script, data)
        if not os.path.exists(os.path.join(src, "data", name, "input.txt")):
            open(os.path.join(data, "input.txt"), "w").write(_text())
        subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True,
                       capture_output=True)
        return
    rng = np.random.default_rng(0)
    rng.integers(0, 50257, size=4_000_000, dtype=np.uint16).tofile(os.path.join(data, "train.bin"))
    rng.integers(0, 50257, size=400_000, dtype=np.uint16).tofile(os.path.join(data, "val.bin"))


def prepare(src: str, where: str, config: str | None = None) -> dict[str, str]:
    """Two copies of the program (torch's and gtmpi's) sharing one dataset; ``config`` a
    file of the checkout's config/ the runs are given."""
    _dataset(src, where, config and os.path.join(src, "config", config))
    dirs = {}
    for kind in ("torch", "gtmpi"):
        d = dirs[kind] = os.path.join(where, kind)
        os.makedirs(d)
        for name in ("train.py", "model.py", "configurator.py", "sample.py"):
            text = open(os.path.join(src, name)).read()
            if kind == "gtmpi" and name != "configurator.py":
                for pattern, repl in SWITCH:
                    text, n = pattern.subn(repl, text)
            open(os.path.join(d, name), "w").write(text)
        if config:
            os.makedirs(os.path.join(d, "config"))
            shutil.copy(os.path.join(src, "config", config), os.path.join(d, "config"))
        os.symlink(os.path.join(where, "data"), os.path.join(d, "data"))
        module = "torch" if kind == "torch" else "gtmpi"
        report = "int(__import__('os').environ.get('RANK', '0')) == 0"
        open(os.path.join(d, "run.py"), "w").write(WRAPPER.format(module=module, report=report))
    return dirs


def _timed_lines(cmd: list[str], cwd: str, env: dict, timeout: int) -> tuple[int, list, float]:
    """The program's output lines, each with the wall time it arrived at (seconds from the
    start); its return code; its whole wall time."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    try:
        lines = [(time.perf_counter() - start, line.rstrip("\n")) for line in proc.stdout]
        rc = proc.wait()
    finally:
        killer.cancel()
    return rc, lines, time.perf_counter() - start


def _windows(lines: list) -> tuple[list[float], float]:
    """ms per iteration of each window between two log lines from iteration 10 on with no
    evaluation inside; and the seconds the windows with one spent beyond their iterations'
    share of the median (the evaluations and the checkpoints they save)."""
    steady, with_eval, last, evaluated = [], [], None, False
    for at, line in lines:
        if EVAL.match(line):
            evaluated = True
        said = LINE.match(line)
        if not said:
            continue
        i = int(said.group(1))
        if last is not None and last[0] >= 10:
            (with_eval if evaluated else steady).append((i - last[0], at - last[1]))
        last, evaluated = (i, at), False
    per_iter = [s / n * 1e3 for n, s in steady]
    ms = statistics.median(per_iter) if per_iter else float("nan")
    return per_iter, sum(s - n * ms / 1e3 for n, s in with_eval)


PHASES = {"model": re.compile(r"^number of parameters"), "eval 0": EVAL,
          "iter 0": re.compile(r"^iter 0:"), "iter 10": re.compile(r"^iter 10:")}


def _phases(lines: list) -> dict[str, float]:
    """Seconds from the start at which the run reached each of PHASES (the model built, the
    first evaluation's line, the first iteration's, the tenth's): where a whole run's time
    beyond its steady iterations goes (start-up, the first evaluation, compilation)."""
    reached = {}
    for at, line in lines:
        for phase, pattern in PHASES.items():
            if phase not in reached and pattern.match(line):
                reached[phase] = round(at, 2)
    return reached


def _host_ms(path: str) -> float | None:
    """Rank 0's host time per iteration from the run's trace (gtmpi-trace steps): the median
    over the iterations from the 10th on, evaluations' included."""
    from gtmpi.recording import fileformat
    from gtmpi.trace.analysis import step_rows
    rows = step_rows(fileformat.read(path))[10:]
    return round(statistics.median(r["host_ms"] for r in rows), 3) if rows else None


def run(name: str, cmd: list[str], cwd: str, env: dict, tokens_per_iter: int | None,
        timeout: int, trace: str | None = None, memory: str | None = None) -> dict:
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    traced = None
    if trace and name.startswith("gtmpi"):
        traced = os.path.join(trace, re.sub(r"\W+", "_", name) + ".h5")
        env = {**env, "GTMPI_TRACE": traced}
    if memory:
        memory = os.path.join(memory, re.sub(r"\W+", "_", name))
        env = {**env, "GTMPI_MEMORY_HISTORY": memory}
    rc, lines, wall = _timed_lines(cmd, cwd, env, timeout)
    out = "\n".join(line for _, line in lines)
    iters = [(int(i), float(loss), float(ms)) for i, loss, ms in
             (m.groups() for m in map(LINE.match, (line for _, line in lines)) if m)]
    peaks = [int(p) for p in re.findall(r"PEAK_BYTES (\d+)", out)]
    if rc != 0 or not iters:
        print(out[-4000:], flush=True)
        return {"run": name, "rc": rc}
    for said in re.findall(r"^(?:repeated runs|worker \d+ |compile: ).*$", out, re.M):
        print(said, flush=True)
    tokens = TOKENS.search(out)
    tokens_per_iter = int(tokens.group(1).replace(",", "")) if tokens else tokens_per_iter
    per_iter, eval_s = _windows(lines)
    printed = [ms for i, _, ms in iters if i >= 10] or [ms for _, _, ms in iters[1:]]
    ms = statistics.median(per_iter) if per_iter else statistics.median(printed)
    result = {"run": name, "rc": 0, "ms": round(ms, 2),
              "tokens_per_s": round(tokens_per_iter / ms * 1e3),
              "ms_printed": round(statistics.median(printed), 2), "wall_s": round(wall, 1),
              "eval_s": round(eval_s, 1), "loss0": iters[0][1], "loss_last": iters[-1][1],
              "iters": iters[-1][0],
              "peak_gb": round(max(peaks) / 1e9, 3) if peaks else None,
              "ms_each": [round(ms, 1) for ms in per_iter]}
    result["phases_s"] = _phases(lines)
    if traced:
        result["host_ms"] = _host_ms(traced)
    print(json.dumps(result), flush=True)
    if memory and os.path.isdir(memory):
        from gtmpi.trace.memory import main as memory_report
        memory_report([memory, "--top", "20", "--frames", "3"])
    return result


def one_gpu_runs(runs: list[str], round_: int, py: str, mpiexec: list[str], args_: list[str],
                 dirs: dict[str, str], env: dict, tokens: int, opts) -> list[dict]:
    """torch's original, then gtmpi's one-GPU runs, each tagged with the round it belongs to."""
    trace = opts.trace and os.path.join(opts.trace, f"round{round_}")
    if trace:
        os.makedirs(trace, exist_ok=True)

    def one(name, cmd, cwd, run_env):
        result = run(name, cmd, cwd, run_env, tokens, opts.timeout, trace, opts.memory)
        return {**result, "round": round_}
    out = []
    if "torch" in runs:
        out.append(one("torch", [py, "run.py", *args_], dirs["torch"], env))
    if "torch-eager" in runs:
        out.append(one("torch eager", [py, "run.py", *args_, "--compile=False"], dirs["torch"],
                       env))
    if "torch-compiled" in runs:
        out.append(one("torch compiled", [py, "run.py", *args_, "--compile=True"], dirs["torch"],
                       env))
    variants = {"": {"GTMPI_CAPTURE": "0", "GTMPI_COMPILE": "0"},
                "-eager": {"GTMPI_CAPTURE": "0", "GTMPI_AUTO_REPLAY": "0", "GTMPI_COMPILE": "0"},
                "-captured": {"GTMPI_CAPTURE": "1", "GTMPI_COMPILE": "0"},
                "-compiled": {"GTMPI_CAPTURE": "1", "GTMPI_COMPILE": "1"},
                "-default": {}, "-asked": {"GTMPI_COMPILE": "asked"}}
    for variant, extra in variants.items():
        genv = {**env, **extra}
        flag = ["--compile=True"] if variant == "-asked" else []
        if "embedded" + variant in runs:
            out.append(one("gtmpi embedded" + variant, [py, "run.py", *args_, *flag],
                           dirs["gtmpi"], genv))
        if "mpiexec" + variant in runs:
            out.append(one("gtmpi mpiexec -n 2" + variant,
                           [*mpiexec, "-n", "2", py, "run.py", *args_], dirs["gtmpi"], genv))
    return out


def _launch() -> tuple[dict, list[str], str]:
    """The runs' environment, mpiexec's command and the Python that runs them."""
    # each run sets what it captures and compiles itself (its name says it)
    env = {**{k: v for k, v in os.environ.items() if k not in ("GTMPI_CAPTURE", "GTMPI_COMPILE")},
           "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    mpiexec = [shutil.which("mpiexec") or "mpiexec"]
    if "Open MPI" in subprocess.run(mpiexec + ["--version"], capture_output=True,
                                    text=True).stdout:
        mpiexec += ["--bind-to", "none", "--oversubscribe"]
    return env, mpiexec, sys.executable


def _config_main(args, gpus: int) -> None:
    """nanoGPT's own config, as its README runs it: one GPU, every run beside torch's."""
    runs = args.runs.split(",") if args.runs != RUNS else ["torch", "torch-eager", "embedded",
                                                            "mpiexec"]
    given = [f"config/{args.config}.py", f"--max_iters={args.iters}"] + \
        ([] if gpus else ["--device=cpu", "--dtype=float32", "--compile=False"]) + \
        [f"--{kv}" for kv in args.set]
    env, mpiexec, py = _launch()
    results = []
    with tempfile.TemporaryDirectory() as where:
        dirs = prepare(args.path, where, f"{args.config}.py")
        for round_ in range(args.rounds):
            results += one_gpu_runs(runs, round_, py, mpiexec, given, dirs, env, None, args)
    print(f"\nnanoGPT train.py {' '.join(given)}")
    print(f"{'run':24} {'round':>5} {'ms/iter':>8} {'host ms':>8} {'vs torch':>9} {'vs eager':>9} "
          f"{'run s':>7} {'eval s':>7} {'peak GB':>8} {'loss 0':>8} {'loss last':>9}")
    for r in results:
        if r["rc"]:
            print(f"{r['run']:24} failed (rc {r['rc']})")
            continue
        ratios = []
        for peer in ("torch", "torch eager"):  # the peer of the same round: the host drifts
            base = next((b for b in results if b["run"] == peer and b["rc"] == 0 and
                         b["round"] == r["round"]), None)
            ratios.append(round(base["ms"] / r["ms"], 3) if base else None)
        r["vs_torch"], r["vs_torch_eager"] = ratios
        shown = [f"{x:8.3f}x" if x else f"{'-':>9}" for x in ratios]
        print(f"{r['run']:24} {r['round']:5d} {r['ms']:8.2f} {r.get('host_ms') or '-':>8} "
              f"{shown[0]} {shown[1]} "
              f"{r['wall_s']:7.1f} {r['eval_s']:7.1f} {r['peak_gb'] or '-':>8} "
              f"{r['loss0']:8.4f} {r['loss_last']:9.4f}")
    print(f"\nseconds from the start at which each run reached: {', '.join(PHASES)}, its end")
    for r in results:
        if not r["rc"]:
            print(f"{r['run']:24} {r['round']:5d} " + " ".join(
                f"{r['phases_s'].get(p, float('nan')):8.2f}" for p in PHASES) +
                f" {r['wall_s']:8.1f}")
    print(json.dumps({"benchmark": "real", "program": "nanoGPT train.py", "config": args.config,
                      "iters": args.iters, "set": args.set, "runs": results}))


def _sample_main(args, gpus: int) -> None:
    """nanoGPT's sample.py as its README runs it after the character-level training (its
    checkpoint made by two iterations of train.py: the weights' values change no timing), the
    imports switched only: ms per token, each run beside torch's in the same call."""
    runs = args.runs.split(",") if args.runs != RUNS else ["torch", "embedded",
                                                            "embedded-captured",
                                                            "embedded-compiled"]
    on_cpu = [] if gpus else ["--device=cpu", "--dtype=float32"]
    given = ["--out_dir=out-shakespeare-char", f"--num_samples={args.samples}",
             f"--max_new_tokens={args.tokens}", *on_cpu]
    env, mpiexec, py = _launch()
    env["REAL_SCRIPT"] = "sample.py"  # through run.py: gtmpi's runs then say what compiled
    commands = {"torch": ([py, "run.py"], "torch", {}),
                "torch-compiled": ([py, "run.py", "--compile=True"], "torch", {}),
                "embedded": ([py, "run.py"], "gtmpi", {"GTMPI_CAPTURE": "0", "GTMPI_COMPILE": "0"}),
                "embedded-captured": ([py, "run.py"], "gtmpi", {"GTMPI_CAPTURE": "1",
                                                                    "GTMPI_COMPILE": "0"}),
                "embedded-graphed": ([py, "run.py"], "gtmpi", {"GTMPI_CAPTURE": "1",
                                                                   "GTMPI_SIZED_GRAPHS": "1"}),
                "embedded-compiled": ([py, "run.py"], "gtmpi", {"GTMPI_CAPTURE": "1",
                                                                    "GTMPI_COMPILE": "1"}),
                "embedded-default": ([py, "run.py"], "gtmpi", {}),
                "mpiexec": ([*mpiexec, "-n", "2", py, "run.py"], "gtmpi", {"GTMPI_CAPTURE": "0"}),
                "mpiexec-captured": ([*mpiexec, "-n", "2", py, "run.py"], "gtmpi",
                                     {"GTMPI_CAPTURE": "1"})}
    results = []
    with tempfile.TemporaryDirectory() as where:
        dirs = prepare(args.path, where, "train_shakespeare_char.py")
        subprocess.run([py, "train.py", "config/train_shakespeare_char.py", "--max_iters=2",
                        "--eval_interval=2", "--eval_iters=2", "--compile=False", *on_cpu],
                       cwd=dirs["torch"], env=env, check=True, capture_output=True)
        os.symlink(os.path.join(dirs["torch"], "out-shakespeare-char"),
                   os.path.join(dirs["gtmpi"], "out-shakespeare-char"))
        for round_ in range(args.rounds):
            for name in runs:
                cmd, kind, extra = commands[name]
                print(f"== {name}: {' '.join(cmd + given)}", flush=True)
                rc, lines, wall = _timed_lines(cmd + given, dirs[kind], {**env, **extra},
                                               args.timeout)
                for _, said in lines:
                    if re.match(r"(worker \d+ |compile: )", said):
                        print(said, flush=True)
                ends = [at for at, line in lines if line.startswith("---------------")]
                # a sample's time: from the end of the one before (the first warms up)
                each = [(b - a) / args.tokens * 1e3 for a, b in zip(ends, ends[1:])]
                if rc or not each:
                    print("\n".join(line for _, line in lines[-20:]))
                results.append({"run": name, "round": round_, "rc": rc or (0 if each else 1),
                                "ms_per_token": round(statistics.median(each), 3) if each
                                else None, "ms_each": [round(x, 2) for x in each],
                                "wall_s": round(wall, 1)})
                print(json.dumps(results[-1]), flush=True)
    print(f"\nnanoGPT sample.py {' '.join(given)}")
    print(f"{'run':20} {'round':>5} {'ms/token':>9} {'vs torch':>9} {'run s':>7}")
    for r in results:
        base = next((b for b in results if b["run"] == "torch" and b["rc"] == 0 and
                     b["round"] == r["round"]), None)
        r["vs_torch"] = round(base["ms_per_token"] / r["ms_per_token"], 3) \
            if base and r["ms_per_token"] else None
        print(f"{r['run']:20} {r['round']:5d} {r['ms_per_token'] or '-':>9} "
              f"{r['vs_torch'] or '-':>8}x {r['wall_s']:7.1f}")
    print(json.dumps({"benchmark": "real", "program": "nanoGPT sample.py",
                      "samples": args.samples, "tokens": args.tokens, "runs": results}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", help="a checkout of karpathy/nanoGPT")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8, help="sequences per GPU")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs for the DP runs (default: all)")
    ap.add_argument("--runs", default=RUNS)
    ap.add_argument("--size", default="gpt2", choices=["gpt2", "tiny"],
                    help="tiny: 2 layers of 64 on 64 tokens, to try it on CPUs")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--rounds", type=int, default=1,
                    help="the one-GPU runs this many times, interleaved (torch, gtmpi, torch, ...): "
                    "the host's drift from call to call shows as the spread of the ratios")
    ap.add_argument("--trace", metavar="DIR", help="gtmpi's runs traced into DIR/<run>.h5 (the "
                    "one-GPU runs into DIR/round<N>/<run>.h5)")
    ap.add_argument("--memory", metavar="DIR", help="every run's GPU allocations recorded into "
                    "DIR/<run>/ (GTMPI_MEMORY_HISTORY) and what was live at its peak printed")
    ap.add_argument("--config", metavar="NAME", help="nanoGPT's config/NAME.py as it is, only "
                    "--max_iters set to --iters (runs: torch,torch-eager,embedded,mpiexec unless "
                    "--runs says)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="with --config: passed on to train.py as --KEY=VALUE (e.g. a smaller "
                    "model to try it on CPUs)")
    ap.add_argument("--sample", action="store_true",
                    help="sample.py instead of train.py: ms per token (--samples, --tokens)")
    ap.add_argument("--samples", type=int, default=3, help="with --sample: samples drawn")
    ap.add_argument("--tokens", type=int, default=300, help="with --sample: tokens per sample")
    args = ap.parse_args()
    import torch
    gpus = args.gpus or torch.cuda.device_count()
    if args.sample:
        _sample_main(args, gpus)
        return
    if args.config:
        _config_main(args, gpus)
        return
    shape = ["--n_layer=12", "--n_head=12", "--n_embd=768", "--block_size=1024"] \
        if args.size == "gpt2" else ["--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64"]
    block = 1024 if args.size == "gpt2" else 64
    device = ["--device=cuda", "--dtype=bfloat16"] if gpus else ["--device=cpu", "--dtype=float32"]
    common = [*shape, *device, "--compile=False", "--dropout=0.0", f"--max_iters={args.iters}",
              "--eval_interval=100000", "--eval_iters=1", "--log_interval=1",
              "--always_save_checkpoint=False"]
    one = [f"--batch_size={args.batch}", "--gradient_accumulation_steps=1"]
    env, mpiexec, py = _launch()
    runs = args.runs.split(",")
    results = []
    with tempfile.TemporaryDirectory() as where:
        dirs = prepare(args.path, where)
        tokens = args.batch * block
        for round_ in range(args.rounds):
            results += one_gpu_runs(runs, round_, py, mpiexec, common + one, dirs, env, tokens, args)
        if gpus > 1 and "ddp" in runs:
            results.append(run(f"torch DDP x{gpus}", [py, "-m", "torch.distributed.run",
                                                      "--standalone", f"--nproc-per-node={gpus}",
                                                      "run.py", *common,
                                                      f"--batch_size={args.batch}",
                                                      f"--gradient_accumulation_steps={gpus}"],
                               dirs["torch"], env, tokens * gpus, args.timeout))
        for replayed in ("", "-replayed"):
            if gpus < 2 or "dp-config" + replayed not in runs:
                continue
            dp_env = {**env, "GTMPI_CONFIG": os.path.join(ROOT, "configs", "ddp.yaml"),
                      **({"GTMPI_AUTO_REPLAY_PLACED": "1"} if replayed else {})}
            results.append(run(f"gtmpi DP x{gpus} (config{', replayed' if replayed else ''})",
                               [*mpiexec, "-n", str(gpus + 1), py, "run.py", *common,
                                f"--batch_size={args.batch * gpus}",
                                "--gradient_accumulation_steps=1"], dirs["gtmpi"], dp_env,
                               tokens * gpus, args.timeout, args.trace, args.memory))
    torch_of = {r.get("round"): r for r in results if r["run"] == "torch" and r["rc"] == 0}
    first = torch_of.get(0)
    one_gpu = {r["run"]: r for r in results if r["rc"] == 0 and r.get("round", 0) == 0}
    print(f"\nnanoGPT train.py, {args.size}, batch {args.batch} per GPU, {args.iters} iterations")
    print(f"{'run':28} {'round':>5} {'ms/iter':>9} {'host ms':>8} {'tokens/s':>10} {'vs torch':>9} "
          f"{'peak GB':>8} {'loss 0':>8} {'loss last':>9}")
    for r in results:
        if r["rc"]:
            print(f"{r['run']:28} failed (rc {r['rc']})")
            continue
        # each round's gtmpi runs against the torch run of the same round: the host drifts
        base = torch_of.get(r.get("round"), first)
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        r["vs_torch"] = round(ratio, 3)
        print(f"{r['run']:28} {r.get('round', 0):5d} {r['ms']:9.2f} {r.get('host_ms') or '-':>8} "
              f"{r['tokens_per_s']:10d} "
              f"{ratio:8.3f}x {r['peak_gb'] if r['peak_gb'] is not None else '-':>8} "
              f"{r['loss0']:8.4f} {r['loss_last']:9.4f}")
    if args.rounds > 1:
        for name in dict.fromkeys(r["run"] for r in results if "round" in r and r["rc"] == 0):
            ratios = sorted(r["vs_torch"] for r in results if r["run"] == name and r["rc"] == 0)
            print(f"{name}: vs torch over {len(ratios)} rounds: median "
                  f"{statistics.median(ratios):.3f}x, range {ratios[0]:.3f}-{ratios[-1]:.3f}x")
    for name in list(one_gpu):
        if name.startswith("gtmpi DP") and "gtmpi embedded" in one_gpu:
            one_gpu[name]["vs_gtmpi_one_gpu"] = round(
                one_gpu[name]["tokens_per_s"] / one_gpu["gtmpi embedded"]["tokens_per_s"], 3)
            print(f"{name}: {one_gpu[name]['vs_gtmpi_one_gpu']}x gtmpi on one GPU")
    print(json.dumps({"benchmark": "real", "program": "nanoGPT train.py", "size": args.size,
                      "batch_per_gpu": args.batch, "gpus": gpus, "runs": results}))


if __name__ == "__main__":
    main()
