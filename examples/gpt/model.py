"""A GPT (nanoGPT's shape: token and position embeddings, pre-norm blocks of causal multi-head
attention and a GELU MLP, a final LayerNorm and a language-model head), written once for
either library: ``build(torch)`` gives a plain PyTorch model, ``build(gtmpi)`` the same model
on gtmpi. The two have the same parameter names, so one's state_dict loads into the other.
"""
from __future__ import annotations

import functools
import importlib
import itertools
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Callable


@dataclass(frozen=True)
class Config:
    vocab: int
    seq: int       # the longest sequence (the position table's size)
    layers: int
    heads: int
    dim: int


SIZES = {
    "tiny": Config(vocab=256, seq=64, layers=2, heads=4, dim=64),
    "d384": Config(vocab=4096, seq=256, layers=6, heads=6, dim=384),
    "gpt2": Config(vocab=50304, seq=1024, layers=12, heads=12, dim=768),   # GPT-2 small
    "mini": Config(vocab=50257, seq=1024, layers=8, heads=16, dim=1024),   # the seed's Mini-GPT
    "6.7b": Config(vocab=50304, seq=1024, layers=32, heads=32, dim=4096),  # GPT-3 6.7B's shape
}


def build(lib: ModuleType) -> type:
    """The GPT class on ``lib`` (torch or gtmpi)."""
    nn, F = lib.nn, lib.nn.functional
    checkpointing = importlib.import_module(f"{lib.__name__}.utils.checkpoint")
    checkpoint = checkpointing.checkpoint
    # --checkpoint-activations selective (Megatron's): the matmuls' and attention's outputs
    # kept, the norms, GELU and adds recomputed; torch names the kernels these ops run
    aten = getattr(getattr(lib, "ops", None), "aten", None)
    kept = ["linear", "matmul", "scaled_dot_product_attention"] if aten is None else \
        [getattr(aten, name).default for name in
         ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
          "_scaled_dot_product_flash_attention_for_cpu")]
    selective = functools.partial(checkpointing.create_selective_checkpoint_contexts, kept)

    class Attention(nn.Module):
        def __init__(self, c: Config) -> None:
            super().__init__()
            self.heads = c.heads
            self.qkv = nn.Linear(c.dim, 3 * c.dim)
            self.proj = nn.Linear(c.dim, c.dim)

        def forward(self, x):
            B, T, C = x.shape
            D = C // self.heads
            # the projection's rows are laid out head by head (each head's q, k, v together,
            # as Megatron lays them out), so that splitting its rows over workers splits heads
            # (one transpose before the split rather than one per q, k, v, and one reshape back:
            # the same memory layout in fewer ops, which counts on workers issuing hundreds)
            q, k, v = self.qkv(x).view(B, T, self.heads, 3 * D).transpose(1, 2).split(D, dim=3)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(B, T, C))

    class Block(nn.Module):
        def __init__(self, c: Config) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(c.dim)
            self.attn = Attention(c)
            self.ln2 = nn.LayerNorm(c.dim)
            self.fc = nn.Linear(c.dim, 4 * c.dim)
            self.out = nn.Linear(4 * c.dim, c.dim)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, c: Config) -> None:
            super().__init__()
            self.config = c
            self.tokens = nn.Embedding(c.vocab, c.dim)
            self.positions = nn.Embedding(c.seq, c.dim)
            self.blocks = nn.ModuleList([Block(c) for _ in range(c.layers)])
            self.ln = nn.LayerNorm(c.dim)
            self.head = nn.Linear(c.dim, c.vocab, bias=False)
            self.register_buffer("position_ids", lib.arange(c.seq))
            # --checkpoint-activations full: each block's activations recomputed in backward
            # instead of kept (its input alone is), one more forward per block; "selective":
            # the matmuls' outputs kept, what is cheap to make again recomputed
            self.checkpointing: str | None = None
            # --loss-chunk-rows N: the head and its loss N rows at a time, the whole logits
            # never held (nn.functional.linear_cross_entropy: gtmpi's, torch's from 2.13)
            self.loss_chunk_rows = None

        def forward(self, idx, targets=None):
            x = self.embed(idx)
            for block in self.blocks:
                x = self.run(block, x)
            return self.finish(x, targets)

        def run(self, block, x):
            if self.checkpointing and self.training:
                keep = {"context_fn": selective} if self.checkpointing == "selective" else {}
                return checkpoint(block, x, use_reentrant=False, **keep)
            return block(x)

        def embed(self, idx):
            return self.tokens(idx) + self.positions(self.position_ids[:idx.shape[1]])

        def finish(self, x, targets=None):
            """The logits, or the mean loss where targets are given."""
            if targets is not None and self.loss_chunk_rows:
                B, T, C = x.shape
                rows = lib.nn.LinearCrossEntropyOptions(batch_chunk_size=self.loss_chunk_rows)
                return F.linear_cross_entropy(self.ln(x).view(B * T, C), self.head.weight,
                                              targets.view(B * T), options=rows)
            logits = self.head(self.ln(x))
            if targets is None:
                return logits
            B, T, V = logits.shape
            return F.cross_entropy(logits.view(B * T, V), targets.view(B * T))

    return GPT


def tensor_parallel(model, vocab: bool = True) -> dict[str, str]:
    """Megatron's layout of the GPT's weights, as the signal each parameter (and buffer) goes
    to: ``col`` (rows split: the attention's QKV projection and the MLP's first layer, with
    their biases), ``row`` (columns split: the attention's and the MLP's output projections),
    ``vocab`` (rows split along the vocabulary: the token embedding and the head, whose loss is
    then Megatron's parallel cross-entropy; ``rep`` instead where ``vocab`` is False), ``rep``
    (whole on every member: norms, position table, the output projections' biases, the
    position ids)."""
    out = {name: "rep" for name, _ in model.named_buffers()}
    for name, _ in model.named_parameters():
        layer = name.split(".")[-2]  # the module that holds it
        if layer in ("tokens", "head"):
            out[name] = "vocab" if vocab else "rep"
        elif layer in ("qkv", "fc"):
            out[name] = "col"
        elif layer in ("proj", "out") and name.endswith(".weight"):
            out[name] = "row"
        else:
            out[name] = "rep"
    return out


def stages(model, p: int,
           owner: Callable[[int], int] | None = None) -> list[tuple[list, Callable]]:
    """The GPT cut into ``p`` pipeline stages of consecutive blocks: per stage, the modules
    whose weights it holds, and what it runs. The first embeds the tokens; the last ends with
    the final norm, the head and the loss, and is given the targets. A pipeline runs at the
    pace of its slowest stage, and the head of a large vocabulary costs as much as several
    blocks (GPT-2 small: about 3.7), so the blocks are cut where the stages' costs come closest to
    equal (Megatron's uneven first and last stages), each stage with one block at least but
    the last, which may run the head alone;
    with ``owner`` (chunk -> worker: interleaved and V schedules), where the workers' come
    closest."""
    blocks = list(model.blocks)
    bounds = balanced_bounds(model.config, p, owner)
    out = []
    for s in range(p):
        mine = blocks[bounds[s]:bounds[s + 1]]

        def run(x, targets=None, mine=mine, first=s == 0, last=s == p - 1):
            if first:
                x = model.embed(x)
            for block in mine:
                x = model.run(block, x)
            return model.finish(x, targets) if last else x
        owned = ([model.tokens, model.positions] if s == 0 else []) + mine + \
            ([model.ln, model.head] if s == p - 1 else [])
        out.append((owned, run))
    return out


def balanced_bounds(c: Config, p: int, owner: Callable[[int], int] | None = None) -> list[int]:
    """Block indices cutting ``c.layers`` blocks into ``p`` consecutive chunks (each at least
    one block but the last, which may hold the head alone), chunk k held by worker
    ``owner(k)`` (default: worker k), whose busiest worker's cost is least, and among those
    the most even. The first chunk also embeds, the last runs the head and the loss. Costs
    are per token in FLOPs' worth of GPU time: a block's matmuls and attention, plus its
    memory-bound passes over the activations (norms, residual adds,
    GELU, biases: about twenty, each worth some 1,000·dim FLOPs at a GPU's ratio of bf16 FLOPs
    to bytes); the head's matmul plus the float32 passes of the loss over every logit; the
    embedding's lookups and gradient. Calibrated on GPT-2 small, micro-batches of 8, PP=2 on
    two H200s (kernel profiles of 1F1B and ZB-V, 2026-11-29): a block 9.5 ms a step, the
    head and its loss 35 ms (3.7 blocks; FLOPs alone say 2.4), the embedding 2.8 ms."""
    block = 24 * c.dim * c.dim + 4 * c.dim * c.seq + 20_000 * c.dim
    head = 2 * c.dim * c.vocab + 870 * c.vocab
    embed = 12_000 * c.dim
    owner = owner or (lambda k: k)
    n, workers = c.layers, 1 + max(owner(k) for k in range(p))
    if not 1 <= p <= n + 1:
        raise ValueError(f"{n} blocks cannot make {p} stages")

    def key(bounds: tuple[int, ...]) -> tuple[float, float, float]:
        """(the busiest worker's cost, the sums of squared worker and chunk costs)."""
        loads, squares = [0.0] * workers, 0.0
        for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
            cost = (b - a) * block + (embed if k == 0 else 0) + (head if k == p - 1 else 0)
            loads[owner(k)] += cost
            squares += cost * cost
        return max(loads), sum(x * x for x in loads), squares

    # the last chunk may hold the head alone, when the head costs a stage's share itself
    if math.comb(n, p - 1) <= 20_000:  # every cut (GPT-2's 12 blocks: at most 495)
        return list(min(((0, *cuts, n) for cuts in
                         itertools.combinations(range(1, n + 1), p - 1)), key=key))
    # else from the even cut, one bound moved by one block at a time while that helps
    bounds = [round(k * n / p) for k in range(p + 1)]
    while True:
        moves = [bounds[:k] + [bounds[k] + d] + bounds[k + 1:] for k in range(1, p)
                 for d in (-1, 1)
                 if bounds[k - 1] < bounds[k] + d < bounds[k + 1] + (k == p - 1)]
        better = min(moves, key=lambda b: key(tuple(b)), default=bounds)
        if key(tuple(better)) >= key(tuple(bounds)):
            return bounds
        bounds = better


def parameters(c: Config) -> int:
    """The true parameter count."""
    block = 4 * c.dim + (3 * c.dim * c.dim + 3 * c.dim) + (c.dim * c.dim + c.dim) + \
        (4 * c.dim * c.dim + 4 * c.dim) + (4 * c.dim * c.dim + c.dim)
    return c.vocab * c.dim + c.seq * c.dim + c.layers * block + 2 * c.dim + c.dim * c.vocab


def flops_per_token(c: Config, T: int) -> float:
    """Training FLOPs per token (forward and backward): 6 per weight of the matmuls and the
    embeddings' lookups excluded, plus attention's 12·layers·dim·T (PaLM's appendix B; causal
    kernels skip half of it, counted whole as is customary)."""
    matmul_weights = parameters(c) - c.vocab * c.dim - c.seq * c.dim
    return 6 * matmul_weights + 12 * c.layers * c.dim * T
