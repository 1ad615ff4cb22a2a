"""nanoGPT's train.py, condensed (no DDP, no wandb): the training loop the field copies, with
tests/gpt_torch_style.py as its model. Only the torch import line names torch;
tests/test_torch_port.py runs it as it is and with that line changed to gtmpi's.

Its habits: TF32 switches first thing, an autocast context (nullcontext in float32), batches
sliced out of a uint16 np.memmap at offsets from torch.randint, pinned and moved to the device,
GradScaler (enabled in float16 only) with unscale_ before clipping, gradient accumulation,
torch.compile, @torch.no_grad() evaluation between model.eval() and model.train(), a
checkpoint saved and loaded with map_location.
"""
import math
import os
from contextlib import nullcontext

import numpy as np
import torch

from gpt_torch_style import GPT, GPTConfig


def main(data_dir, out_dir, max_iters=30, dtype="bfloat16", compile=True, seed=1337):
    batch_size, block_size, gradient_accumulation_steps = 4, 32, 2
    learning_rate, min_lr, warmup_iters, lr_decay_iters = 3e-3, 3e-4, 5, max_iters
    weight_decay, beta1, beta2, grad_clip = 0.1, 0.9, 0.95, 1.0
    eval_iters = 2

    torch.manual_seed(seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_type = "cuda" if "cuda" in device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}[dtype]
    ctx = nullcontext() if dtype == "float32" else \
        torch.amp.autocast(device_type=device_type, dtype=ptdtype)

    def get_batch(split):
        data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64))
                         for i in ix])
        if device_type == "cuda":
            x, y = x.pin_memory().to(device, non_blocking=True), \
                y.pin_memory().to(device, non_blocking=True)
        else:
            x, y = x.to(device), y.to(device)
        return x, y

    model = GPT(GPTConfig(block_size=block_size, vocab_size=64, n_layer=2, n_head=4,
                          n_embd=32))
    model.to(device)
    scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))
    optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
    if compile:
        model = torch.compile(model)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    def get_lr(it):
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters:
            return min_lr
        decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return min_lr + coeff * (learning_rate - min_lr)

    first = estimate_loss()
    X, Y = get_batch("train")
    losses = []
    for iter_num in range(max_iters):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        for micro_step in range(gradient_accumulation_steps):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            X, Y = get_batch("train")
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * gradient_accumulation_steps)
    last = estimate_loss()

    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "iter_num": max_iters}
    path = os.path.join(out_dir, "ckpt.pt")
    torch.save(checkpoint, path)
    checkpoint = torch.load(path, map_location=device)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return {"losses": losses, "first": {k: float(v) for k, v in first.items()},
            "last": {k: float(v) for k, v in last.items()}, "dtype": str(logits.dtype),
            "iter_num": checkpoint["iter_num"]}
