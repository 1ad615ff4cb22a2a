"""PyTorch's own way to run each parallel layout of benchmarks/parallel.py, on the same GPT
(examples/gpt/model.py built on torch), the same optimizer (AdamW, clipping at 1.0) and bf16:

    one   one GPU, plain eager PyTorch
    ddp   DistributedDataParallel, --batch split over the GPUs
    fsdp  FSDP2: fully_shard on each block, then on the model, --batch split over the GPUs
    tp    DTensor's Megatron plan (parallelize_module): the attention's QKV and the MLP's first
          layer ColwiseParallel, their output projections RowwiseParallel, the embedding split
          along the vocabulary, the head ColwiseParallel into loss_parallel's cross-entropy
    pp    torch.distributed.pipelining: the blocks cut where gtmpi cuts them
          (model.balanced_bounds), one stage per GPU, Schedule1F1B over --micro-batches

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/torch_peers.py \\
        --layout tp --size gpt2 --batch 16

Batches are random tokens (the speed does not depend on them). Prints one JSON line (rank 0):
tokens/s over --steps after --warmup, peak memory of the busiest GPU, the last losses.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from examples.gpt.model import SIZES, balanced_bounds, build  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", choices=["one", "ddp", "fsdp", "tp", "pp"], required=True)
    p.add_argument("--size", choices=sorted(SIZES), default="gpt2")
    p.add_argument("--batch", type=int, default=16, help="the global batch")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--checkpoint-activations", choices=["none", "full", "selective"],
                   default="none", help="each block checkpointed (torch.utils.checkpoint)")
    p.add_argument("--amp", action="store_true",
                   help="float32 weights and AdamW state, bf16 compute on GPUs: FSDP2 with "
                        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32), "
                        "one GPU under torch.autocast (not with tp or pp)")
    p.add_argument("--fused", action="store_true",
                   help="AdamW(fused=True), the kernel gtmpi's GPU workers use (default: "
                        "torch's own default, foreach on GPUs)")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    gpu = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if gpu else "gloo")
    dtype = torch.bfloat16 if gpu and not args.amp else torch.float32
    if args.amp and args.layout in ("tp", "pp"):
        sys.exit("torch_peers.py: --amp runs the one, ddp and fsdp layouts")
    c = SIZES[args.size]
    torch.manual_seed(0)
    model = build(torch)(c)
    model.checkpointing = None if args.checkpoint_activations == "none" else \
        args.checkpoint_activations
    data_parallel = args.layout in ("ddp", "fsdp")
    local_batch = args.batch // world if data_parallel else args.batch

    if args.layout == "pp":
        model, params, step = _pipeline(model, c, rank, world, device, dtype, args.micro_batches)
    else:
        model = model.to(device, dtype)
        if args.layout == "tp":
            _tensor_parallel(model, world, device)
        if args.layout == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        if args.layout == "fsdp":  # FSDP2's recipe: each block its own unit, then the rest
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            # --amp: bf16 gathered and computed, gradients reduced in float32 (FSDP2's own
            # mixed precision, not autocast)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                          reduce_dtype=torch.float32) if args.amp else \
                MixedPrecisionPolicy()
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                                  enabled=args.amp and args.layout != "fsdp")
        params = list(model.parameters())

        def step(x, y):
            if args.layout == "tp":
                from torch.distributed.tensor.parallel import loss_parallel
                with loss_parallel():
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1))
                    loss.backward()
                return loss.full_tensor()
            with autocast:
                loss = model(x, y)
            loss.backward()
            return loss.detach()

    # the Megatron plan leaves some parameters plain tensors, and AdamW's multi-tensor kernels
    # take no mix of those and DTensors: a group each
    from torch.distributed.tensor import DTensor
    groups = [{"params": [q for q in params if (q.ndim >= 2) == decay
                          and isinstance(q, DTensor) == dtensor],
               "weight_decay": 0.1 if decay else 0.0}
              for decay in (True, False) for dtensor in (True, False)]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=6e-4, betas=(0.9, 0.95),
                            **({"fused": True} if args.fused else {}))
    gen = torch.Generator().manual_seed(1 + (rank if data_parallel else 0))
    data = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in
            torch.randint(0, c.vocab, (4, local_batch, c.seq + 1), generator=gen).to(device)]
    losses, clock = [], 0.0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            _sync(gpu)
            if gpu:
                torch.cuda.reset_peak_memory_stats(device)
            clock = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = step(*data[i % len(data)])
        _clip(params, 1.0, args.layout)
        opt.step()
        if loss is not None:
            losses.append(loss)
    _sync(gpu)
    seconds = (time.perf_counter() - clock) / args.steps
    peak = torch.tensor(float(torch.cuda.max_memory_allocated(device)) if gpu else 0.0,
                        device=device)
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        # the last stage has the losses: rank 0 prints them
        last = torch.stack(losses[-2:]).float() if losses else torch.zeros(2, device=device)
        dist.broadcast(last, world - 1 if args.layout == "pp" else 0)
    else:
        last = torch.stack(losses[-2:]).float()
    if rank == 0:
        print(json.dumps({"peer": args.layout, "size": args.size, "gpus": world,
                          "batch": args.batch, "micro_batches": args.micro_batches
                          if args.layout == "pp" else None, "fused_adamw": args.fused,
                          "tokens_per_s": round(args.batch * c.seq / seconds),
                          "ms_per_step": round(seconds * 1e3, 3),
                          "peak_gb_per_gpu": round(peak.item() / 1e9, 2) if gpu else None,
                          "losses": [round(v, 4) for v in last.tolist()]}), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _sync(gpu: bool) -> None:
    if gpu:
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def _clip(params: list, max_norm: float, layout: str) -> None:
    """Clipping by the global norm, as Megatron computes it where gradients are spread: the
    squares of what is split (a stage's gradients; a DTensor's shards) summed over the ranks
    in one all-reduce, plus those of what every rank holds whole. torch's clip_grad_norm_
    takes no mix of DTensors and tensors, which the Megatron plan leaves (norms, biases); FSDP2
    makes every gradient a DTensor, which it takes."""
    if layout in ("one", "ddp", "fsdp"):
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    from torch.distributed.tensor import DTensor
    grads = [q.grad for q in params if q.grad is not None]
    def is_split(g) -> bool:
        return layout == "pp" or isinstance(g, DTensor) and any(p.is_shard() for p in g.placements)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    split = [t for g, t in zip(grads, local) if is_split(g)]
    whole = [t for g, t in zip(grads, local) if not is_split(g)]
    square = torch.stack(torch._foreach_norm(split)).float().pow(2).sum()
    dist.all_reduce(square)
    if whole:
        square = square + torch.stack(torch._foreach_norm(whole)).float().pow(2).sum()
    coef = (max_norm / (square.sqrt() + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(split + whole, coef.to(grads[0].dtype))


def _tensor_parallel(model, world: int, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(),
                                         "attn.proj": RowwiseParallel(),
                                         "fc": ColwiseParallel(), "out": RowwiseParallel()})
        attn = block.attn
        attn.heads //= world  # each rank's heads: the QKV rows are laid out head by head
        attn.forward = _local_attention(attn)
    parallelize_module(model, mesh, {
        "tokens": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})


def _local_attention(attn):
    """The model's attention on a rank's heads: widths from the local tensors, not the model's."""
    def forward(x):
        B, T, _ = x.shape
        q, k, v = attn.qkv(x).view(B, T, attn.heads, -1).transpose(1, 2).chunk(3, dim=3)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attn.proj(y.transpose(1, 2).reshape(B, T, -1))
    return forward


def _pipeline(model, c, rank: int, world: int, device: torch.device, dtype: torch.dtype,
              micro_batches: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    bounds = balanced_bounds(c, world)
    first, last = rank == 0, rank == world - 1

    class Part(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(model.blocks[bounds[rank]:bounds[rank + 1]])
            if first:
                self.tokens, self.positions = model.tokens, model.positions
                self.register_buffer("position_ids", model.position_ids)
            if last:
                self.ln, self.head = model.ln, model.head

        def forward(self, x):
            if first:
                x = self.tokens(x) + self.positions(self.position_ids[:x.shape[1]])
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x)) if last else x

    part = Part().to(device, dtype)
    stage = PipelineStage(part, rank, world, device)
    schedule = Schedule1F1B(stage, micro_batches, loss_fn=lambda logits, y: F.cross_entropy(
        logits.flatten(0, 1).float(), y.flatten(0, 1)))

    def step(x, y):
        if first:
            schedule.step(x)
            return None
        if last:
            losses = []
            schedule.step(target=y, losses=losses)
            return torch.stack(losses).mean().detach()
        schedule.step()
        return None
    return part, list(part.parameters()), step


if __name__ == "__main__":
    main()
