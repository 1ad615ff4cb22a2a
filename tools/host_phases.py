"""Where rank 0's host time per iteration of nanoGPT's train.py goes, phase by phase, beside
torch's own: a diagnosis, not a benchmark (benchmarks/real.py runs the program unchanged).

A copy of the checkout's train.py gets a clock reading between the phases of its loop (the
rate set, the forward, the loss's scaling, the next batch made, the backward, the clipping, the
optimizer's step and the scaler's update, zero_grad, the timing, the loss read, the print);
both copies (torch's and gtmpi's, imports switched as real.py switches them) run GPT-2 small
(or --size tiny on CPUs) and print the median of each phase from the 10th iteration on, in us.

    python tools/host_phases.py NANOGPT_CHECKOUT [--size gpt2|tiny] [--iters 40]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import real  # noqa: E402  (prepare: the two copies and their dataset)

PHASES = ["rate", "forward", "loss scaled", "next batch", "backward", "clip", "step",
          "zero_grad", "timing", "loss read", "print"]
T = "__import__('time').perf_counter()"
# (the line each mark goes before, the lines put there): one reading per phase boundary
MARKS = [
    ("    lr = get_lr(iter_num) if decay_lr else learning_rate\n", f"    _T = [{T}]\n"),
    ("        with ctx:\n            logits, loss = model(X, Y)\n", f"        _T.append({T})\n"),
    ("            loss = loss / gradient_accumulation_steps", f"            _T.append({T})\n"),
    ("        X, Y = get_batch('train')\n        # backward", f"        _T.append({T})\n"),
    ("        scaler.scale(loss).backward()\n", f"        _T.append({T})\n"),
    ("    # clip the gradient\n", f"    _T.append({T})\n"),
    ("    # step the optimizer and scaler if training in fp16\n", f"    _T.append({T})\n"),
    ("    optimizer.zero_grad(set_to_none=True)\n", f"    _T.append({T})\n"),
    ("    # timing and logging\n", f"    _T.append({T})\n"),
    ("        lossf = loss.item() * gradient_accumulation_steps\n", f"        _T.append({T})\n"),
    ("    iter_num += 1\n", f"    _T.append({T})\n    _ALL.append(_T)\n"),
]
REPORT = """_ALL = []
import atexit, json as _json
def _report():
    import numpy as np
    rows = np.array([t for t in _ALL[10:] if len(t) == len(_ALL[-1])])
    print("PHASES " + _json.dumps((np.median(np.diff(rows, axis=1), axis=0) * 1e6).round(1).tolist()))
atexit.register(_report)
while True:
"""
# the loss read marks only where the loop reads it: after it, one mark more than before it
AFTER_READ = "        lossf = loss.item() * gradient_accumulation_steps\n"


def instrument(path: str) -> None:
    src = open(path).read()
    for before, mark in MARKS:
        if before not in src:
            raise SystemExit(f"{path}: no line {before.strip()!r} (another nanoGPT?)")
        src = src.replace(before, mark + before, 1)
    src = src.replace(AFTER_READ, AFTER_READ + f"        _T.append({T})\n", 1)
    src = src.replace("while True:\n", REPORT, 1)
    open(path, "w").write(src)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", help="a checkout of karpathy/nanoGPT")
    ap.add_argument("--size", choices=["gpt2", "tiny"], default="gpt2")
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args()
    import torch
    gpu = torch.cuda.is_available()
    shape = ["--n_layer=12", "--n_head=12", "--n_embd=768", "--block_size=1024"] \
        if args.size == "gpt2" else ["--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64"]
    device = ["--device=cuda", "--dtype=bfloat16"] if gpu else ["--device=cpu", "--dtype=float32"]
    given = [*shape, *device, "--compile=False", "--dropout=0.0", f"--max_iters={args.iters}",
             "--eval_interval=100000", "--eval_iters=1", "--log_interval=1",
             "--always_save_checkpoint=False", "--batch_size=8", "--gradient_accumulation_steps=1"]
    env, _, py = real._launch()
    rows = {}
    with tempfile.TemporaryDirectory() as where:
        dirs = real.prepare(args.path, where)
        for kind in ("torch", "gtmpi"):
            instrument(os.path.join(dirs[kind], "train.py"))
            out = subprocess.run([py, "run.py", *given], cwd=dirs[kind], env=env,
                                 capture_output=True, text=True, timeout=600)
            line = next((l for l in out.stdout.splitlines() if l.startswith("PHASES ")), None)
            if line is None:
                raise SystemExit(f"{kind}: no phases\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
            rows[kind] = json.loads(line[len("PHASES "):])
    print(f"rank 0's host time per iteration by phase, us (median from the 10th of {args.iters}; "
          f"nanoGPT {args.size}, {'GPU' if gpu else 'CPU'})")
    print(f"{'phase':<12} {'torch':>10} {'gtmpi':>10}")
    for i, name in enumerate(PHASES):
        print(f"{name:<12} {rows['torch'][i]:>10.1f} {rows['gtmpi'][i]:>10.1f}")
    host = {k: round(sum(v) - v[PHASES.index("loss read")], 1) for k, v in rows.items()}
    print(f"{'all but the read':<12} {host['torch']:>10.1f} {host['gtmpi']:>10.1f}")
    print(json.dumps({"tool": "host_phases", "size": args.size, "phases": PHASES, **rows,
                      "host_us": host}))


if __name__ == "__main__":
    main()
