"""Tensors the client holds itself until a worker needs them.

torch makes a tensor without a device on the CPU; so does gtmpi: values made from host data
(``tensor``, ``from_numpy``), drawn from torch's CPU generator (``randn``, ``randint``,
``nn.init``), or small constants stay in the client as a plain CPU torch tensor. Reads of them
cost no round trip (``for i in torch.randint(n, (8,))`` reads nothing), and small ops on them
run here, as torch's CPU would run them (``torch.stack`` of a batch's rows). The first op that
needs one on a worker places it: one upload of its bytes, or, for a constant made by a recipe
(``zeros``, ``arange``), the recipe itself run where it is used (no bytes, and a replay can
repeat it). Inside a signal's scope a value is placed by the signal at once (a parameter's
storage made by ``empty`` waits for its init first); inside a replayable function nothing
stays here.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ..ops import OPS, Kind

# Ops on host operands run here while their operands hold at most this many elements in all:
# a batch's rows stacked, an index picked. Larger work goes to a worker, as the program meant.
HOST_NUMEL = 1 << 16
# Kinds a host op may be of: the rest need a worker (fused kernels and their Graphs,
# collectives). Of these, random ops carry a worker's seed and the optimizers' multi-tensor
# updates keep state that lives on the workers: both stay there.
_KINDS = frozenset({Kind.ELEMENTWISE, Kind.REDUCE, Kind.MATMUL, Kind.SHAPE, Kind.INDEX,
                    Kind.INPLACE, Kind.GENERAL})
_ON_WORKERS = frozenset({"normal_", "uniform_", "multinomial", "vjp", "getitem_grad",
                     "batch_norm_update_", "adam_foreach", "sgd_foreach", "adam_steps",
                     "norm_foreach", "zero_foreach", "mul_foreach", "add_foreach"})
# GTMPI_HOST_TENSORS=0: every tensor to a worker at once (read at import: every op asks)
HELD = os.environ.get("GTMPI_HOST_TENSORS", "1") != "0"
HOST_OPS = frozenset(name for name, op in OPS.items() if op.kind in _KINDS) - _ON_WORKERS


def meta(rt: Any, numel: int) -> bool:
    """Whether a value of ``numel`` elements is held as a meta tensor (shape and dtype, no
    data): in a dry run, above HOST_NUMEL, where its values would be zeros on the simulated
    workers anyway (a 6.7B model's weights would otherwise fill the client's memory)."""
    return numel > HOST_NUMEL and rt.dry_run is not None


def allowed(rt: Any, device: Any = None) -> bool:
    """Whether a tensor made now with ``device`` may be made by the client: not on a named GPU,
    nor inside a replayable function (a replay cannot repeat an upload, and its calls draw
    alike, from the workers' generators)."""
    if not HELD:
        return False
    if device is not None and torch.device(device).type != "cpu":
        return False
    d = rt.dispatcher
    return not d.in_replayable and d.recording is None


def varying(rt: Any) -> bool:
    """Whether a signal open now places what is made as varying (V): each worker draws its
    own numbers, so a draw cannot be the client's."""
    return any(kind == "V" for target, _ in rt.dispatcher.placer.signals
               for kind, _ in target.per_axis())


def scope(rt: Any, sig: tuple) -> tuple:
    """The signal scopes open now: a value of ``sig`` held here is placed inside them when
    used. Their placements are checked for it now, as a tensor placed at once would be."""
    rt.dispatcher.placer.check_open(sig)
    return tuple(name for name, _ in rt.signals.open)

