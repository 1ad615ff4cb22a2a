"""Every parallel layout of the GPT on the GPUs this machine has, each beside PyTorch's own
way to run it, in one run:

    python benchmarks/parallel.py                    # GPT-2 small, global batch 16
    python benchmarks/parallel.py --size tiny --steps 6 --gpus 2    # a check on CPUs

| layout         | gtmpi (examples/gpt/train.py + a config) | PyTorch (benchmarks/torch_peers.py) |
| one GPU        | one worker                               | eager                               |
| DP=n           | configs' data/weights signals            | DistributedDataParallel             |
| DP=n ZeRO-1/2  | the same with the weights' zero: 1 or 2  | (none: the DP=n row's DDP is the peer) |
| DP=n ZeRO-3    | the same with zero: 3 (FSDP)             | FSDP2, fully_shard per block        |
| DP=n ZeRO-3 at use | the same, GTMPI_ZERO_AHEAD=0 (no prefetch) | (none: the ZeRO-3 row's FSDP2) |
| DP=n ZeRO-2/3 one by one | the same, GTMPI_ZERO_BUCKETS=0     | (none: the rows above)              |
| DP=n ZeRO-3 coalesced | the same, GTMPI_ZERO_COALESCE=1      | (none: the ZeRO-3 row's FSDP2)      |
| DP=n ZeRO-3 amp (bf16 gathers) | float32 weights, bf16 autocast (--dtype amp); GTMPI_ZERO_CAST=1 | (none) |
| TP=2           | configs/gpt_tp2.yaml (Megatron)          | DTensor's Megatron plan             |
| TP=2 serial    | the same, GTMPI_OVERLAP=0                | (the overlap's baseline)            |
| PP=2           | configs/pipeline.yaml, 1F1B              | torch.distributed.pipelining 1F1B   |
| PP=2 interleaved | the same, 2 chunks per stage           | (none: the 1F1B row is the peer)    |
| PP=2 ZB-H1     | the same, zero bubble's ZB-H1            | (none: the 1F1B row is the peer)    |
| PP=2 ZB-V      | the same, ZB-V (2 chunks per stage, a V) | (none: the 1F1B row is the peer)    |
| TP=2 x PP=2    | configs/gpt_tp2_pp2.yaml, 1F1B           | (none here: Megatron-core is not    |
|                |                                          |  installed, and torch has no recipe)|
| PP=4           | four stages, one GPU each, 1F1B          | torch.distributed.pipelining 1F1B   |
| PP=4 ...       | interleaved, ZB-H1, ZB-V, as for PP=2    | (none: the PP=4 row is the peer)    |
| one GPU ckpt   | --checkpoint-activations full, selective | (none: the one GPU row is the peer; |
|                |                                          |  its ratio is the step time's cost) |

Each is a fresh process group (mpiexec for gtmpi, torch.distributed.run for PyTorch), run one
after another on the same GPUs. Ratios are to one GPU of the same library: at the same global
batch for TP and PP, at the same batch per GPU for DP (DP=n trains n times the batch). For the
pipelines, a second, shorter gtmpi run records the workers' kernels (GTMPI_PROFILE): a stage's
bubble is the part of its step with no computing kernel running (NCCL alone or idle), beside
its schedule's own (pipeline.bubble). Prints a table, then one JSON line of every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from gtmpi.pipeline import bubble  # noqa: E402
from gtmpi.trace import kernels  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="gpt2")
    p.add_argument("--batch", type=int, default=16, help="global batch of TP and PP; DP: per GPU x 8/16")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--gpus", type=int, default=None, help="default: every GPU found")
    p.add_argument("--logs", default=None, help="folder for every run's output")
    p.add_argument("--torch-fused", action="store_true",
                   help="PyTorch's runs with AdamW(fused=True), the kernel gtmpi's GPU workers "
                        "use (default: torch's own default)")
    p.add_argument("--layouts", default=None,
                   help="run only these layouts, comma-separated names as the table prints them "
                        "(\"DP=4,PP=4\"), with the one-GPU rows they are set against; "
                        "default: all")
    args = p.parse_args()
    # the one-GPU reference rows always run: every ratio is to them
    only = set(args.layouts.split(",")) | {"one GPU"} if args.layouts else None
    gpus = args.gpus or _gpus()
    logs = args.logs or tempfile.mkdtemp(prefix="parallel-")
    os.makedirs(logs, exist_ok=True)
    per_gpu = args.batch // 2  # DP rows: the batch per GPU of DP=2 at the global batch
    rows = []

    def layout(name: str, n: int, batch: int, config: str | None, peer: str | None,
               one_batch: int, pipeline: tuple[int, int] | None = None,
               env: dict | None = None, schedule: tuple[str, int] = ("1f1b", 1),
               flags: tuple[str, ...] = ()) -> None:
        if n > gpus or (only is not None and name not in only):
            return
        extra = ("--schedule", schedule[0], "--virtual-stages", str(schedule[1]), *flags)
        g = _gtmpi(name, n, batch, config, args, logs, env=env, extra=extra)
        t = _torch(name, peer, n, batch, args, logs) if peer else None
        row = {"layout": name, "gpus": n, "batch": batch, "gtmpi": g, "torch": t,
               "one_batch": one_batch}
        if pipeline and g:
            profile = os.path.join(logs, f"kernels-{name}")
            _gtmpi(f"{name}-profiled", n, batch, config, args, logs, steps=16,
                   env={"GTMPI_PROFILE": profile, "GTMPI_PROFILE_REPLAYS": "8:4"}, extra=extra)
            row["bubble"] = _bubble(profile)
            p_, m = pipeline
            # the schedule's own, its forward, input-gradient and weight-gradient passes alike
            row["bubble_expected"] = round(bubble(p_, m, *schedule), 3)
        rows.append(row)

    dp_configs = _write_dp_configs(logs, gpus)
    # the DP rows' reference at their batch per GPU, the others' at the global batch: each
    # only where a row of its kind runs (both are named "one GPU" in the table)
    dp = only is None or any(n.startswith("DP=") for n in only)
    if dp:
        layout("one GPU", 1, per_gpu, None, "one", per_gpu)
    if not dp or only is None or any(not n.startswith(("DP=", "one GPU")) for n in only):
        layout("one GPU", 1, args.batch, None, "one", args.batch)
    # activation checkpointing's cost in step time (the ratio) and what it saves (peak GB)
    for mode in ("full", "selective"):
        layout(f"one GPU ckpt {mode}", 1, args.batch, None, None, args.batch,
               flags=("--checkpoint-activations", mode))
    for n in (2, 4, 8):
        layout(f"DP={n}", n, per_gpu * n, dp_configs.get(n), "ddp", per_gpu)
        for zero in (1, 2, 3):  # DDP's row, in the same run, is the peer of ZeRO-1 and -2
            layout(f"DP={n} ZeRO-{zero}", n, per_gpu * n, dp_configs.get((n, zero)),
                   "fsdp" if zero == 3 else None, per_gpu)
        # each op's weights gathered where it reads them, not one op ahead (FSDP's prefetch)
        layout(f"DP={n} ZeRO-3 at use", n, per_gpu * n, dp_configs.get((n, 3)), None, per_gpu,
               env={"GTMPI_ZERO_AHEAD": "0"})
        # an op's weights gathered ahead in one coalesced collective (GTMPI_ZERO_COALESCE=1)
        layout(f"DP={n} ZeRO-3 coalesced", n, per_gpu * n, dp_configs.get((n, 3)), None,
               per_gpu, env={"GTMPI_ZERO_COALESCE": "1"})
        # float32 weights under bf16 autocast: ZeRO-3 gathering float32 and casting in the
        # kernel, and gathering bf16 casts of the pieces (GTMPI_ZERO_CAST=1, off by default)
        for name, env in (("amp", None), ("amp bf16 gathers", {"GTMPI_ZERO_CAST": "1"})):
            layout(f"DP={n} ZeRO-3 {name}", n, per_gpu * n, dp_configs.get((n, 3)), None,
                   per_gpu, env=env, flags=("--dtype", "amp"))
        # each gradient reduce-scattered alone, not a bucket at a time (GTMPI_ZERO_BUCKETS=0)
        for zero in (2, 3):
            layout(f"DP={n} ZeRO-{zero} one by one", n, per_gpu * n, dp_configs.get((n, zero)),
                   None, per_gpu, env={"GTMPI_ZERO_BUCKETS": "0"})
    layout("TP=2", 2, args.batch, os.path.join(ROOT, "configs/gpt_tp2.yaml"), "tp", args.batch)
    # the same without the input gradients' all-reduces run beside the weights' gradients
    layout("TP=2 serial", 2, args.batch, os.path.join(ROOT, "configs/gpt_tp2.yaml"), None,
           args.batch, env={"GTMPI_OVERLAP": "0"})
    layout("PP=2", 2, args.batch, os.path.join(ROOT, "configs/pipeline.yaml"), "pp", args.batch,
           (2, args.micro_batches))
    layout("PP=2 interleaved", 2, args.batch, os.path.join(ROOT, "configs/pipeline.yaml"), None,
           args.batch, (2, args.micro_batches), schedule=("interleaved", 2))
    layout("PP=2 ZB-H1", 2, args.batch, os.path.join(ROOT, "configs/pipeline.yaml"), None,
           args.batch, (2, args.micro_batches), schedule=("zbh1", 1))
    layout("PP=2 ZB-V", 2, args.batch, os.path.join(ROOT, "configs/pipeline.yaml"), None,
           args.batch, (2, args.micro_batches), schedule=("zbv", 2))
    layout("TP=2 x PP=2", 4, args.batch, os.path.join(ROOT, "configs/gpt_tp2_pp2.yaml"), None,
           args.batch, (2, args.micro_batches))
    if gpus >= 4:
        four = _write_stages_config(logs, 4)
        for name, schedule in (("PP=4", ("1f1b", 1)), ("PP=4 interleaved", ("interleaved", 2)),
                               ("PP=4 ZB-H1", ("zbh1", 1)), ("PP=4 ZB-V", ("zbv", 2))):
            layout(name, 4, args.batch, four, "pp" if name == "PP=4" else None, args.batch,
                   (4, args.micro_batches), schedule=schedule)
    _report(rows, args)


def _gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
        return max(1, len(out.stdout.strip().splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return 2  # CPUs: workers as processes


def _write_dp_configs(folder: str, gpus: int) -> dict:
    """configs/data_parallel.yaml's signals over n workers, for each n the GPUs allow (by n),
    and with the weights' ZeRO level (by (n, level))."""
    out: dict = {}
    for n in (2, 4, 8):
        for zero in (0, 1, 2, 3):
            if n <= gpus:
                path = os.path.join(folder, f"data_parallel{n}-zero{zero}.yaml")
                workers = list(range(n))
                with open(path, "w") as f:
                    f.write(f"data:\n  shard: {{axis: 0, workers: {workers}}}\n"
                            f"weights:\n  shard: {{workers: {workers}, replicated: true}}\n"
                            f"  zero: {zero}\n")
                out[(n, zero) if zero else n] = path
    return out


def _write_stages_config(folder: str, stages: int) -> str:
    """configs/pipeline.yaml's signals for ``stages`` stages, one worker each."""
    path = os.path.join(folder, f"pipeline{stages}.yaml")
    with open(path, "w") as f:
        f.writelines(f"stage{s}:\n  shard:\n    workers: [{s}]\n" for s in range(stages))
    return path


def _run(name: str, cmd: list[str], env: dict, logs: str, timeout: int = 300) -> dict | None:
    """One run's last JSON line, its output kept in logs/NAME.log (None if it failed)."""
    path = os.path.join(logs, name.replace(" ", "").replace("=", "") + ".log")
    with open(path, "w") as log:
        try:
            rc = subprocess.run(cmd, env={**os.environ, **env}, stdout=log,
                                stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    lines = [line for line in open(path) if line.startswith("{")]
    if rc != 0 or not lines:
        print(f"{name}: failed (rc {rc}), see {path}", flush=True)
        return None
    return json.loads(lines[-1])


def _gtmpi(name: str, n: int, batch: int, config: str | None, args, logs: str,
           steps: int | None = None, env: dict | None = None, extra: tuple = ()) -> dict | None:
    cmd = ["mpiexec", "--bind-to", "none", "-n", str(n + 1), sys.executable,
           os.path.join(ROOT, "examples/gpt/train.py"), "--size", args.size, "--batch",
           str(batch), "--steps", str(steps or args.steps), "--log-every", "100",
           "--micro-batches", str(args.micro_batches), *extra]
    return _run(f"gtmpi {name} {batch}", cmd, {"GTMPI_PLACEMENT": "strict", **(env or {}),
                                               **({"GTMPI_CONFIG": config} if config else {})},
                logs)


def _torch(name: str, peer: str, n: int, batch: int, args, logs: str,
           extra: tuple = ()) -> dict | None:
    script = os.path.join(HERE, "torch_peers.py")
    opts = ["--layout", peer, "--size", args.size, "--batch", str(batch), "--steps",
            str(max(args.steps - 6, 3)), "--micro-batches", str(args.micro_batches),
            *(["--fused"] if args.torch_fused else []), *extra]
    cmd = [sys.executable, script, *opts] if n == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(n), script, *opts]
    return _run(f"torch {name} {batch}", cmd, {}, logs)


def _bubble(folder: str) -> list[float] | None:
    """Per worker: the part of the time every worker was recording (several whole steps) in
    which it ran no computing kernel, from the kernel profiles."""
    if not os.path.isdir(folder):
        return None
    profiles = [kernels.load(os.path.join(folder, f)) for f in sorted(os.listdir(folder))]
    profiles = [k for k in profiles if k]
    if not profiles:
        return None
    lo, hi = kernels.shared_window(profiles)
    return [round(1 - kernels.fractions(k, lo, hi)["compute"], 3) for k in profiles]


def _report(rows: list[dict], args) -> None:
    def one(lib: str, batch: int) -> float | None:
        for r in rows:
            if r["layout"] == "one GPU" and r["batch"] == batch and r[lib]:
                return r[lib]["tokens_per_s"]
        return None

    print(f"\nGPT {args.size}, seq from the model, bf16 on GPUs, AdamW; tokens/s; ratios to one "
          "GPU of the same library (DP: at the same batch per GPU)")
    head = (f"{'layout':<13} {'GPUs':>4} {'batch':>5} {'gtmpi':>10} {'ratio':>6} {'torch':>10} "
            f"{'ratio':>6} {'gtmpi GB':>8} {'torch GB':>8} {'instr':>6} {'graphs':>6} bubble")
    print(head)
    print("-" * len(head))
    figures = []
    for r in rows:
        g, t = r["gtmpi"] or {}, r["torch"] or {}
        g_one, t_one = one("gtmpi", r["one_batch"]), one("torch", r["one_batch"])
        gr = g.get("tokens_per_s")
        tr = t.get("tokens_per_s")
        r["gtmpi_ratio"] = round(gr / g_one, 3) if gr and g_one else None
        r["torch_ratio"] = round(tr / t_one, 3) if tr and t_one else None
        bubble = (f"{', '.join(f'{b:.3f}' for b in r['bubble'])} (ideal "
                  f"{r['bubble_expected']:.3f})" if r.get("bubble") else "")
        print(f"{r['layout']:<13} {r['gpus']:>4} {r['batch']:>5} {_n(gr):>10} "
              f"{_n(r['gtmpi_ratio'], 3):>6} {_n(tr):>10} {_n(r['torch_ratio'], 3):>6} "
              f"{_n(g.get('peak_gb_per_gpu'), 2):>8} {_n(t.get('peak_gb_per_gpu'), 2):>8} "
              f"{_n(g.get('instructions_per_step'), 0):>6} "
              f"{_n(g.get('graph_launches_per_step'), 2):>6} {bubble}")
        figures.append({"layout": r["layout"], "gpus": r["gpus"], "batch": r["batch"],
                        "gtmpi_tokens_per_s": gr, "gtmpi_ratio": r["gtmpi_ratio"],
                        "torch_tokens_per_s": tr, "torch_ratio": r["torch_ratio"],
                        "gtmpi_peak_gb": g.get("peak_gb_per_gpu"),
                        "torch_peak_gb": t.get("peak_gb_per_gpu"),
                        "instructions_per_step": g.get("instructions_per_step"),
                        "graph_launches_per_step": g.get("graph_launches_per_step"),
                        "bubble": r.get("bubble"), "bubble_expected": r.get("bubble_expected"),
                        "gtmpi_losses": (g.get("losses") or [])[-2:],
                        "torch_losses": t.get("losses")})
    print(json.dumps({"benchmark": "parallel", "size": args.size, "layouts": figures}))


def _n(v, digits: int | None = None) -> str:
    if v is None:
        return "-"
    if digits is None:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


if __name__ == "__main__":
    main()
