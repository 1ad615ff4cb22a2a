"""A GPT trained by plain PyTorch and by gtmpi, side by side on the same device, in one run.

    mpiexec -n 2 python benchmarks/gpt.py --size gpt2     # gtmpi with one worker process
    python benchmarks/gpt.py --size d384                  # gtmpi's embedded worker
    python benchmarks/gpt.py --size tiny --steps 3        # a CPU check
    mpiexec -n 3 python benchmarks/gpt.py --size d384 --batch 16 --data-parallel
                                                          # each batch split over 2 workers;
                                                          # torch also runs one GPU's share

The model is examples/gpt/model.py, defined once for both libraries. Both start from the same
seeded weights (torch's, loaded into gtmpi's model) and train on the same random batches with
AdamW, so their first losses must agree: the benchmark checks it and fails where they do not.
Per side: ms per step (the mean over --steps after --warmup steps; losses are read after the
timed steps, as a loop that logs every few steps does), tokens/s, MFU (on an H100/H200, against
989 TFLOP/s dense bf16) and peak memory over the timed steps (torch's allocator: the most
allocated, and reserved; a compiler's warm-up and gtmpi's steps run as written before a replay
are not the steady step's).
torch.compile of the same model is timed as a reference (--compile). gtmpi's worker instruction
count per step is printed too. Ends with one JSON line of the figures.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gtmpi  # noqa: E402  (under mpiexec, ranks > 0 become workers here)
from examples.gpt.model import (SIZES, build, flops_per_token, parameters,  # noqa: E402
                                tensor_parallel)

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16, SXM


def batches(c, batch: int, count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, c.vocab, (count, batch, c.seq + 1), generator=gen)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def forward_backward(model):
    def step(x, y):
        loss = model(x, y)
        loss.backward()
        return loss
    return step


def train(step, opt, data, steps: int, warmup: int, sync,
          on_start=None) -> tuple[list[float], float, float]:
    """Losses of every step (``step`` runs forward and backward), seconds per step over the
    timed ones, and seconds of the warm-up steps (a compiler's time is there); ``on_start`` is
    called as the timed steps begin."""
    losses = []
    began = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:  # the warm-up ends on the device before the clock starts
            sync()
            if on_start is not None:
                on_start()
            start = time.perf_counter()
            warm = start - began
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        loss = step(x, y)
        opt.step()
        losses.append(loss)
    losses[-1].item()
    sync()
    seconds = (time.perf_counter() - start) / steps
    return [float(loss.item()) for loss in losses], seconds, warm


def _explained() -> str:
    out = io.StringIO()
    gtmpi.debug.explain(file=out)
    return out.getvalue()


def _held_by(t, rank: int) -> int:
    """Bytes of ``t`` that worker ``rank`` holds, from its placement (its piece of a split
    tensor; all of a whole one)."""
    piece = gtmpi.debug.placement(t)["shards"].get(rank)
    return 0 if piece is None else math.prod(piece) * t.element_size()


def per_step(before: dict, after: dict, steps: int) -> dict[str, tuple[float, float]]:
    """Collectives and transfers a worker ran (the dispatcher inserted them all), by kind:
    (count, bytes) per step."""
    out = {}
    for kind, (n, b) in after.items():
        n0, b0 = before.get(kind, (0, 0))
        if n != n0:
            out[kind] = ((n - n0) / steps, (b - b0) / steps)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: 20 on GPU, 3 on CPU)")
    p.add_argument("--warmup", type=int, default=None, help="steps before timing (default: 8 on GPU, 1 on CPU: a replayed "
                        "step runs slower for its first few replays)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="weights and activations (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile (a reference)")
    p.add_argument("--no-torch", action="store_true", help="time gtmpi alone (profiling)")
    p.add_argument("--fused-peer", action="store_true",
                   help="also time torch with AdamW(fused=True), the kernel gtmpi's GPU workers "
                        "use by default (torch's default is foreach)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="trace gtmpi's timed steps into FILE (gtmpi-trace reads it)")
    p.add_argument("--no-replay", action="store_true",
                   help="gtmpi issues every step's ops (by default the second step's are "
                        "recorded and later steps replay them: gtmpi.replayable)")
    p.add_argument("--checkpoint-activations", choices=["none", "full", "selective"],
                   default="none",
                   help="full: each block's activations recomputed in backward, on both sides "
                        "(torch.utils.checkpoint for torch); selective: the matmuls' and "
                        "attention's outputs kept (torch's selective checkpoint contexts)")
    p.add_argument("--loss-chunk-rows", type=int, default=0, metavar="N",
                   help="the head and loss N rows at a time (F.linear_cross_entropy with "
                        "LinearCrossEntropyOptions); torch before 2.13, which has no such "
                        "function, keeps its whole logits")
    p.add_argument("--data-parallel", action="store_true",
                   help="gtmpi splits each batch over all its workers (weights replicated, "
                        "gradients all-reduced); torch runs the same batch on one GPU")
    p.add_argument("--tensor-parallel", action="store_true",
                   help="gtmpi splits the blocks' weights Megatron's way over all its workers "
                        "(model.tensor_parallel); torch runs the model on one GPU")
    args = p.parse_args()
    if args.data_parallel and args.tensor_parallel:
        p.error("--data-parallel or --tensor-parallel, not both")

    world = gtmpi.info()
    device = torch.device(world["workers"][min(world["workers"])]["device"])
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.set_device(device)
    steps = args.steps or (20 if gpu else 3)
    warmup = args.warmup if args.warmup is not None else (8 if gpu else 1)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if gpu else "fp32")]
    c = SIZES[args.size]
    data = batches(c, args.batch, 4)
    name = torch.cuda.get_device_name(device) if gpu else platform.processor() or "cpu"
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    tokens = args.batch * c.seq

    def sync():
        if gpu:
            torch.cuda.synchronize(device)

    torch.manual_seed(0)
    reference = build(torch)(c)
    init = {k: v.clone() for k, v in reference.state_dict().items()}
    whole_weights = sum(v.numel() * (dtype.itemsize if v.is_floating_point() else v.element_size())
                        for v in init.values())
    res: dict[str, dict] = {}

    def run_torch(label: str, compiled: bool, rows: int | None = None, fused: bool = False) -> None:
        """``rows``: the first rows of each batch only (one GPU's share of a split batch);
        ``fused``: AdamW's fused kernel instead of torch's default (foreach on GPUs)."""
        model = build(torch)(c).to(device=device)
        model.load_state_dict(init)
        model.to(dtype)
        model.checkpointing = None if args.checkpoint_activations == "none" else \
        args.checkpoint_activations
        if hasattr(torch.nn, "LinearCrossEntropyOptions"):  # torch 2.13 chunks it too
            model.loss_chunk_rows = args.loss_chunk_rows or None
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                **({"fused": True} if fused else {}))
        step_model = torch.compile(model) if compiled else model
        on_device = [(x[:rows].to(device), y[:rows].to(device)) for x, y in data]
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        losses, seconds, warm = train(forward_backward(step_model), opt, on_device, steps,
                                      warmup, sync,
                                      (lambda: torch.cuda.reset_peak_memory_stats(device))
                                      if gpu else None)
        res[label] = {"losses": losses, "s": seconds, "warmup_s": warm,
                      "peak": torch.cuda.max_memory_allocated(device) if gpu else None,
                      "reserved": torch.cuda.max_memory_reserved(device) if gpu else None}
        del model, opt, step_model, on_device
        if gpu:
            torch.cuda.empty_cache()

    share = args.batch // len(world["workers"])
    if not args.no_torch:
        run_torch("torch", False)
        if args.fused_peer:
            run_torch("torch_fused", False, fused=True)
        if args.compile:
            run_torch("compile", True)
        if args.data_parallel:  # data parallelism scales against one GPU at its batch per GPU
            run_torch("torch/gpu", False, share)

    everyone = list(range(len(world["workers"])))
    whole = {"shard": {"workers": everyone, "replicated": True}}
    gtmpi.load_config({"dp_data": {"shard": {"axis": 0, "workers": everyone}},
                       "dp_weights": whole, "act": whole, "rep": whole,
                       "col": {"shard": {"axis": 0, "workers": everyone}},
                       "vocab": {"shard": {"axis": 0, "workers": everyone}},
                       "row": {"shard": {"axis": 1, "workers": everyone}}})
    parallel = args.data_parallel
    with gtmpi.signal.context("dp_weights") if parallel else contextlib.nullcontext():
        model = build(gtmpi)(c)
    model.load_state_dict(init)
    model.checkpointing = None if args.checkpoint_activations == "none" else \
        args.checkpoint_activations
    model.loss_chunk_rows = args.loss_chunk_rows or None
    if args.tensor_parallel:
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        for key, signal in tensor_parallel(model).items():
            gtmpi.signal.place(tensors[key], signal)
    model.to(dtype)
    home = min(world["workers"])
    weights = sum(_held_by(t, home) for t in [*model.parameters(), *model.buffers()])
    opt = gtmpi.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    batch_signal = "dp_data" if parallel else "act" if args.tensor_parallel else None
    on_workers = [(gtmpi.signal.tensor(x, batch_signal), gtmpi.signal.tensor(y, batch_signal))
                  if batch_signal else (gtmpi.tensor(x, device="cuda"), gtmpi.tensor(y, device="cuda"))
                  for x, y in data]
    before = gtmpi.debug.worker_stats()[home]
    step = forward_backward(model)
    if not args.no_replay:
        step = gtmpi.replayable(step)
    def timed() -> None:  # the peak of the steady steps; the trace of them
        gtmpi.debug.worker_stats(reset_peak=True)
        if args.trace:
            gtmpi.trace.start(args.trace)
    losses, seconds, warm = train(step, opt, on_workers, steps, warmup, gtmpi.synchronize,
                                  timed)
    if args.trace:
        gtmpi.trace.stop()
    after = gtmpi.debug.worker_stats()[home]
    res["gtmpi"] = {"losses": losses, "s": seconds, "warmup_s": warm,
                    "peak": after.get("peak_bytes"),
                    "weights": weights,
                    "reserved": after.get("peak_reserved_bytes"),
                    "instructions": (after["ops"] - before["ops"] - 1) / (warmup + steps),
                    "graphed": (after["graphed_ops"] - before["graphed_ops"]) / (warmup + steps),
                    "launches": (after["graph_launches"] - before["graph_launches"]) / (warmup + steps),
                    "collectives": per_step(before["collectives"], after["collectives"],
                                            warmup + steps)}

    flops = flops_per_token(c, c.seq) * tokens
    print(f"GPT {args.size} ({parameters(c) / 1e6:.1f}M parameters: {c.layers} layers, dim {c.dim}, "
          f"{c.heads} heads, seq {c.seq}, vocab {c.vocab}), batch {args.batch}, {str(dtype)[6:]}, "
          f"AdamW; {steps} steps timed after {warmup}; activations checkpointed: "
          f"{args.checkpoint_activations}; loss in chunks of "
          f"{args.loss_chunk_rows or 'all'} rows"
          f"{'' if hasattr(torch.nn, 'LinearCrossEntropyOptions') else ' (gtmpi only)'}")
    print(f"device {device} ({name}, {platform.node()}); gtmpi: {len(world['workers'])} worker(s)"
          f"{' (embedded)' if world['embedded'] else ' (mpiexec)'}; torch {torch.__version__}")
    print(f"{'':<10} {'ms/step':>9} {'tokens/s':>11} {'MFU':>7} {'peak GB':>9} {'reserved GB':>12} "
          f"{'first loss':>11} {'last loss':>10} {'warm-up s':>10}")
    for label, r in res.items():
        r["tokens_per_s"] = (share if label == "torch/gpu" else args.batch) * c.seq / r["s"]
        gpus = len(world["workers"]) if label == "gtmpi" and gpu else 1  # MFU per GPU used
        r["mfu"] = r["tokens_per_s"] * flops / tokens / peak / gpus if peak else None
        mfu = f"{r['mfu'] * 100:6.1f}%" if r["mfu"] is not None else f"{'-':>7}"
        mem = f"{r['peak'] / 1e9:9.2f} {r['reserved'] / 1e9:12.2f}" if r["peak"] else f"{'-':>9} {'-':>12}"
        print(f"{label:<10} {r['s'] * 1e3:9.2f} {r['tokens_per_s']:11.0f} {mfu} {mem} "
              f"{r['losses'][0]:11.4f} {r['losses'][-1]:10.4f} {r['warmup_s']:10.1f}")
    g = res["gtmpi"]
    print(f"gtmpi: {g['instructions'] + g['graphed']:.0f} worker instructions per step, "
          f"{'replayed from the second step on' if not args.no_replay else 'each issued by rank 0'}"
          f"; {g['graphed']:.0f} of them in CUDA graphs, {g['launches']:.2f} graph launches per "
          f"step ({gtmpi.debug.graph_notes() or 'no graph tried'})")
    compiles = [line.strip() for line in _explained().splitlines() if "compiled" in line]
    if compiles:  # GTMPI_COMPILE: each program's compile time, or why it was not compiled
        print("gtmpi: " + "\ngtmpi: ".join(compiles))
    inserted = {kind: (round(n, 2), round(b / 1e6, 2))
                for kind, (n, b) in res["gtmpi"]["collectives"].items()}
    print(f"gtmpi: collectives and transfers per step on the first worker, (count, MB): "
          f"{inserted or 'none'}")
    out = {"benchmark": "gpt", "size": args.size, "batch": args.batch, "dtype": str(dtype)[6:],
           "replay": not args.no_replay, "checkpoint_activations": args.checkpoint_activations,
           "loss_chunk_rows": args.loss_chunk_rows,
           "data_parallel": parallel, "tensor_parallel": args.tensor_parallel,
           "device": name, "host": platform.node(), "workers": len(world["workers"]),
           "embedded": world["embedded"], "steps": steps, "warmup": warmup,
           "gtmpi_instructions_per_step": round(g["instructions"] + g["graphed"], 1),
           "gtmpi_graphed_per_step": round(g["graphed"], 1),
           "gtmpi_graph_launches_per_step": round(g["launches"], 2),
           "gtmpi_collectives_per_step": inserted,
           "gtmpi_weights_bytes": res["gtmpi"]["weights"],
           "torch_weights_bytes": whole_weights}
    print(f"weights and buffers per GPU (by their placements): one GPU "
          f"{whole_weights / 1e9:.3f} GB, gtmpi's first worker {res['gtmpi']['weights'] / 1e9:.3f} GB "
          f"({res['gtmpi']['weights'] / whole_weights:.3f}x)")
    for label, r in res.items():
        out.update({f"{label}_ms": round(r["s"] * 1e3, 3), f"{label}_tokens_per_s": round(r["tokens_per_s"]),
                    f"{label}_mfu": None if r["mfu"] is None else round(r["mfu"], 4),
                    f"{label}_peak_bytes": r["peak"], f"{label}_reserved_bytes": r["reserved"],
                    f"{label}_losses": [round(v, 5) for v in r["losses"]],
                    f"{label}_warmup_s": round(r["warmup_s"], 2)})
    if "torch" in res:
        t, g = res["torch"], res["gtmpi"]
        out["speed_ratio"] = round(g["tokens_per_s"] / t["tokens_per_s"], 4)
        out["memory_ratio"] = round(g["peak"] / t["peak"], 4) if t["peak"] else None
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        out["first_losses_agree"] = abs(g["losses"][0] - t["losses"][0]) <= tol * abs(t["losses"][0])
        if "compile" in res:
            out["speed_ratio_compiled"] = round(g["tokens_per_s"] / res["compile"]["tokens_per_s"], 4)
            out["memory_ratio_compiled"] = round(g["peak"] / res["compile"]["peak"], 4) \
                if res["compile"]["peak"] else None
            print(f"gtmpi/torch.compile: speed {out['speed_ratio_compiled']:.3f}, peak memory "
                  f"{out['memory_ratio_compiled'] or '-'}")
        if "torch_fused" in res:
            out["speed_ratio_fused"] = round(g["tokens_per_s"] / res["torch_fused"]["tokens_per_s"], 4)
            print(f"gtmpi/torch with AdamW(fused=True): speed {out['speed_ratio_fused']:.3f}")
        if "torch/gpu" in res:
            out["scaling"] = round(g["tokens_per_s"] / res["torch/gpu"]["tokens_per_s"], 4)
            print(f"data parallel: {out['scaling']:.3f}x the tokens/s of torch on one GPU at "
                  f"the batch per GPU ({share})")
        print(f"gtmpi/torch: speed {out['speed_ratio']:.3f}, peak memory "
              f"{out['memory_ratio'] if out['memory_ratio'] else '-'}; first losses "
              f"{'agree' if out['first_losses_agree'] else 'DIFFER'}")
    print(json.dumps(out))
    if "torch" in res and not out["first_losses_agree"]:
        sys.exit("gtmpi's first loss differs from torch's")


if __name__ == "__main__":
    main()
