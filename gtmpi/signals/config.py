"""Sharding configs: named signals and where their tensors go, from YAML or a dict.

GT's keys, as GT's users wrote them:

    data:                      # a signal's name
      shard:
        axis: 0                # S(axis) over the workers below
        workers: [0, 1]        # worker indices (0 is the first worker, MPI rank 1)
      backward: data_grad      # the signal whose placement the backward pass takes
      compile: false           # ask workers to compile repeated sequences (hot paths)
    weights:
      shard: {workers: [0, 1], replicated: true}   # R: a whole copy on each
      zero: 1                  # ZeRO-1: each keeps 1/n of the optimizer's state of what this
                               # signal places (2: of the gradients too)

Beyond GT, a named mesh of several axes with a placement per axis (R, S(i) or P), so that
data and tensor parallelism are one config:

    activations:
      mesh: {dp: 2, tp: 2}               # axis sizes; over workers 0-3 (or shard.workers)
      placement: {dp: S(0), tp: R}
    column_weights:
      mesh: {dp: 2, tp: 2}
      placement: {dp: R, tp: S(0)}

Every error names the file (or "<dict>"), the signal and the key.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

_SIGNAL_KEYS = {"shard", "backward", "compile", "mesh", "placement", "zero"}
_SHARD_KEYS = {"axis", "workers", "replicated"}


class ConfigError(ValueError):
    """A config that cannot be used: the message names the file, the signal and the key."""


@dataclass(frozen=True)
class Signal:
    name: str
    source: str                 # the file it came from, or "<dict>"
    workers: tuple[int, ...]    # worker indices; () in a config: all the job has
    axis: int | None            # None: replicated
    backward: str | None = None
    compile: bool = False
    grid: tuple[int, ...] = ()  # a named mesh: its axis sizes ...
    axes: tuple[tuple[str, int], ...] = ()  # ... and (kind, dim) per axis
    axis_names: tuple[str, ...] = ()
    # data parallelism that shards what the replicas would each keep whole (ZeRO): 1, the
    # optimizer's state; 2, the gradients too (0: every replica keeps everything)
    zero: int = 0

    def where(self, key: str) -> str:
        return f"{self.source}: signal '{self.name}', key '{key}'"


def parse(config: Any, source: str) -> dict[str, Signal]:
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: a config maps signal names to their settings, "
                          f"got {type(config).__name__}")
    return {str(name): _signal(str(name), body, source) for name, body in config.items()}


def load(path: str) -> dict[str, Signal]:
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    return parse(config or {}, path)


def _mapping(body: Any, known: set[str], where: str, prefix: str) -> None:
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: expected a mapping of settings, got {body!r}")
    unknown = sorted(set(body) - known)
    if unknown:
        signal = where.split(", key")[0]
        raise ConfigError(f"{signal}, key '{prefix}{unknown[0]}': unknown key "
                          f"(known: {', '.join(sorted(known))})")


def _indices(workers: Any) -> bool:
    """A list of distinct worker indices (0, 1, ...)."""
    return isinstance(workers, list) and \
        all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in workers) and \
        len(set(workers)) == len(workers)


def _signal(name: str, body: Any, source: str) -> Signal:
    where = f"{source}: signal '{name}'"
    _mapping(body, _SIGNAL_KEYS, where, "")
    shard = body.get("shard", {})
    _mapping(shard, _SHARD_KEYS, f"{where}, key 'shard'", "shard.")
    backward = body.get("backward")
    if backward is not None and not isinstance(backward, str):
        raise ConfigError(f"{where}, key 'backward': expected a signal name")
    compile_ = body.get("compile", False)
    if not isinstance(compile_, bool):
        raise ConfigError(f"{where}, key 'compile': expected true or false")
    zero = body.get("zero", 0)
    if zero not in (0, 1, 2, 3) or isinstance(zero, bool):
        raise ConfigError(f"{where}, key 'zero': expected 0, 1, 2 or 3, got {zero!r}")
    mesh = body.get("mesh")
    if mesh is not None:
        if zero:
            raise ConfigError(f"{where}, key 'zero': a signal with a mesh cannot say it yet (a "
                              "replicated signal over its data-parallel workers can)")
        return _named_mesh(name, body, shard, mesh, where, source, backward, compile_)
    workers = shard.get("workers", [0])
    every = workers == "all"  # every worker of the job, counted when the config is loaded
    if not every and (not _indices(workers) or not workers):
        raise ConfigError(f"{where}, key 'shard.workers': expected a list of distinct worker "
                          f"indices (0, 1, ...) or 'all', got {workers!r}")
    replicated = shard.get("replicated", False)
    if not isinstance(replicated, bool):
        raise ConfigError(f"{where}, key 'shard.replicated': expected true or false")
    axis = shard.get("axis")
    if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
        raise ConfigError(f"{where}, key 'shard.axis': expected an integer, got {axis!r}")
    if replicated and axis is not None:
        raise ConfigError(f"{where}, key 'shard.replicated': a signal is either sharded along "
                          "an axis or replicated, not both")
    if not replicated and axis is None and (every or len(workers) > 1):
        raise ConfigError(f"{where}, key 'shard.axis': several workers need an axis to shard "
                          "along, or replicated: true")
    if zero and not replicated:
        raise ConfigError(f"{where}, key 'zero': ZeRO shards what replicas keep: the signal must "
                          "be replicated (shard: {workers: ..., replicated: true})")
    return Signal(name, source, () if every else tuple(workers), None if replicated else axis,
                  backward, compile_, zero=zero)


def _named_mesh(name: str, body: dict, shard: dict, mesh: Any, where: str, source: str,
                backward: str | None, compile_: bool) -> Signal:
    if not isinstance(mesh, dict) or not mesh or \
            not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in mesh.values()):
        raise ConfigError(f"{where}, key 'mesh': expected axis names with their sizes, like "
                          f"{{dp: 2, tp: 2}}, got {mesh!r}")
    for key in ("axis", "replicated"):
        if key in shard:
            raise ConfigError(f"{where}, key 'shard.{key}': a signal with a mesh says how it is "
                              "laid out per axis in 'placement'")
    placement = body.get("placement")
    if not isinstance(placement, dict) or set(placement) != set(mesh):
        raise ConfigError(f"{where}, key 'placement': expected one of R, I, S(i), P, V for each mesh "
                          f"axis ({', '.join(mesh)}), got {placement!r}")
    axes = []
    for axis in mesh:
        match = re.fullmatch(r"\s*(R|I|P|V|S\(\s*(-?\d+)\s*\))\s*", str(placement[axis]))
        if match is None:
            raise ConfigError(f"{where}, key 'placement.{axis}': expected R, I, S(i), P or V, "
                              f"got {placement[axis]!r}")
        axes.append(("S", int(match.group(2))) if match.group(2) else (match.group(1), 0))
    sharded = [d for k, d in axes if k == "S"]
    if len(sharded) != len(set(sharded)):
        raise ConfigError(f"{where}, key 'placement': two axes shard the same dim")
    size = math.prod(mesh.values())
    workers = shard.get("workers", list(range(size)))
    if not _indices(workers) or len(workers) != size:
        raise ConfigError(f"{where}, key 'shard.workers': a mesh of {size} needs {size} distinct "
                          f"worker indices, got {workers!r}")
    return Signal(name, source, tuple(workers), None, backward, compile_,
                  tuple(mesh.values()), tuple(axes), tuple(mesh))
