"""A GPT larger than one GPU holds with replicated data parallelism: GPT-3 6.7B's shape (32
layers, dim 4096, 32 heads, seq 1024, vocab 50304) on every GPU found, gtmpi beside torch with
the same recipe, in one run:

    python benchmarks/large.py                               # every GPU found
    python benchmarks/large.py --size tiny --gpus 2 --steps 6    # a check on CPUs

gtmpi: examples/gpt/train.py, on several GPUs with configs/fsdp.yaml (ZeRO-3: weights,
gradients and AdamW's moments in pieces, each weight gathered for the op that reads it), every
block's activations checkpointed and the loss in chunks of rows (F.linear_cross_entropy).
torch: benchmarks/torch_peers.py, FSDP2 (fully_shard per block, then the model) on several
GPUs, plain eager on one, every block checkpointed (torch.utils.checkpoint); torch before 2.13
has no chunked loss, so it holds the whole logits. Both in bf16 (weights and optimizer state,
as train.py and torch_peers.py run every size; --dtype amp: float32 weights and state, bf16
compute, FSDP2's MixedPrecisionPolicy beside gtmpi's bf16 gathers), AdamW, clipping at 1.0;
--batch sequences per GPU. Prints a table (tokens/s, MFU, peak memory per GPU) and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

from parallel import ROOT, _gpus, _gtmpi, _n, _torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="6.7b")
    p.add_argument("--batch", type=int, default=8, help="sequences per GPU")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--gpus", type=int, default=None, help="default: every GPU found")
    p.add_argument("--checkpoint-activations", choices=["none", "full", "selective"],
                   default="full")
    p.add_argument("--loss-chunk-rows", type=int, default=2048, help="gtmpi's (0: whole)")
    p.add_argument("--dtype", choices=["bf16", "amp"], default="bf16",
                   help="bf16: weights and AdamW state in bf16; amp: in float32, bf16 compute "
                        "(gtmpi: train.py --dtype amp with bf16 gathers, GTMPI_ZERO_CAST=1; "
                        "torch: FSDP2's MixedPrecisionPolicy, autocast on one GPU)")
    p.add_argument("--logs", default=None, help="folder for every run's output")
    p.add_argument("--resume-check", default=None, metavar="DIR",
                   help="instead of the comparison: gtmpi's run stopped 2 steps short saving a "
                        "sharded checkpoint in DIR (each worker its pieces), then a run that "
                        "resumes from it; prints both times and the last losses beside an "
                        "unstopped run's")
    args = p.parse_args()
    args.micro_batches, args.torch_fused = 1, False  # what parallel.py's runners read
    n = args.gpus or _gpus()
    logs = args.logs or tempfile.mkdtemp(prefix="large-")
    os.makedirs(logs, exist_ok=True)
    batch = args.batch * n
    config = os.path.join(ROOT, "configs/fsdp.yaml") if n > 1 else None
    ckpt = ("--checkpoint-activations", args.checkpoint_activations)
    if args.resume_check:
        _resume_check(args, n, batch, config, ckpt, logs)
        return
    amp = args.dtype == "amp"
    g = _gtmpi(f"FSDP={n}", n, batch, config, args, logs,
               env={"GTMPI_ZERO_CAST": "1"} if amp else None,
               extra=(*ckpt, "--loss-chunk-rows", str(args.loss_chunk_rows),
                      "--eval-batches", "1", *(("--dtype", "amp") if amp else ())))
    t = _torch(f"FSDP={n}", "fsdp" if n > 1 else "one", n, batch, args, logs,
               extra=(*ckpt, *(("--amp",) if amp else ())))
    g, t = g or {}, t or {}
    gr, tr = g.get("tokens_per_s"), t.get("tokens_per_s")
    # the same model and tokens: torch's MFU is gtmpi's scaled by the speeds
    t_mfu = g["mfu"] * tr / gr if g.get("mfu") and gr and tr else None
    print(f"\nGPT {args.size} ({g.get('parameters', 0) / 1e9:.2f}B parameters), {n} GPU(s), "
          f"{args.batch} sequences per GPU, "
          f"{'float32 weights, bf16 compute' if amp else 'bf16'}, AdamW, activations checkpointed: "
          f"{args.checkpoint_activations}")
    head = f"{'':<6} {'tokens/s':>10} {'MFU':>6} {'peak GB/GPU':>12} {'last loss':>10}"
    print(head + "\n" + "-" * len(head))
    for name, r, mfu in (("gtmpi", g, g.get("mfu")), ("torch", t, t_mfu)):
        losses = r.get("losses") or [None]
        print(f"{name:<6} {_n(r.get('tokens_per_s')):>10} "
              f"{(f'{mfu * 100:.1f}%' if mfu else '-'):>6} "
              f"{_n(r.get('peak_gb_per_gpu'), 2):>12} {_n(losses[-1], 4):>10}")
    print(f"gtmpi/torch: {_n(gr / tr if gr and tr else None, 3)}")
    print(json.dumps({"benchmark": "large", "size": args.size, "gpus": n, "dtype": args.dtype,
                      "batch_per_gpu": args.batch, "checkpointing": args.checkpoint_activations,
                      "gtmpi_tokens_per_s": gr, "gtmpi_mfu": g.get("mfu"),
                      "gtmpi_peak_gb": g.get("peak_gb_per_gpu"),
                      "torch_tokens_per_s": tr, "torch_mfu": t_mfu and round(t_mfu, 4),
                      "torch_peak_gb": t.get("peak_gb_per_gpu"),
                      "vs_torch": round(gr / tr, 3) if gr and tr else None}))


def _resume_check(args, n: int, batch: int, config: str | None, ckpt: tuple, logs: str) -> None:
    """A sharded checkpoint of the model and AdamW's state, written and read back by the
    workers, the training going on as unstopped."""
    extra = (*ckpt, "--loss-chunk-rows", str(args.loss_chunk_rows), "--eval-batches", "1")
    where = ("--checkpoint", args.resume_check, "--sharded")
    whole = _gtmpi(f"whole={n}", n, batch, config, args, logs, extra=extra)
    stop = str(args.steps - 2)
    _gtmpi(f"saved={n}", n, batch, config, args, logs, extra=(*extra, *where, "--stop-at", stop))
    # the resumed run saves nothing: a second 6.7B checkpoint beside the first fills one
    # GPU host's disk (68.7 GB each, 2026-12-04)
    resumed = _gtmpi(f"resumed={n}", n, batch, config, args, logs,
                     extra=(*extra, *where, "--resume", "--save-every", "-1"))
    said = {}
    for name in ("saved", "resumed"):
        for line in open(os.path.join(logs, f"gtmpi{name}{n}{batch}.log")):
            if line.startswith(f"{name} "):
                said[name] = line.strip()
    size = sum(os.path.getsize(os.path.join(args.resume_check, f))
               for f in os.listdir(args.resume_check)) if os.path.isdir(args.resume_check) else 0
    last = [r.get("losses", [])[-2:] if r else None for r in (whole, resumed)]
    print(f"\nGPT {args.size}, {n} GPU(s): sharded checkpoint {size / 1e9:.2f} GB on disk")
    print(f"  {said.get('saved', 'save failed')}\n  {said.get('resumed', 'resume failed')}")
    print(f"  last losses unstopped {last[0]}, resumed {last[1]}")
    print(json.dumps({"benchmark": "large-resume", "size": args.size, "gpus": n,
                      "checkpoint_gb": round(size / 1e9, 2), "saved": said.get("saved"),
                      "resumed": said.get("resumed"), "unstopped_losses": last[0],
                      "resumed_losses": last[1], "equal": last[0] == last[1]}))


if __name__ == "__main__":
    main()
