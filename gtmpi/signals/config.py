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

Every error names the file (or "<dict>"), the signal and the key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_SIGNAL_KEYS = {"shard", "backward", "compile"}
_SHARD_KEYS = {"axis", "workers", "replicated"}


class ConfigError(ValueError):
    """A config that cannot be used: the message names the file, the signal and the key."""


@dataclass(frozen=True)
class Signal:
    name: str
    source: str                 # the file it came from, or "<dict>"
    workers: tuple[int, ...]    # worker indices
    axis: int | None            # None: replicated
    backward: str | None = None
    compile: bool = False

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


def _signal(name: str, body: Any, source: str) -> Signal:
    where = f"{source}: signal '{name}'"
    _mapping(body, _SIGNAL_KEYS, where, "")
    shard = body.get("shard", {})
    _mapping(shard, _SHARD_KEYS, f"{where}, key 'shard'", "shard.")
    workers = shard.get("workers", [0])
    if not isinstance(workers, list) or not workers or \
            not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in workers) \
            or len(set(workers)) != len(workers):
        raise ConfigError(f"{where}, key 'shard.workers': expected a list of distinct worker "
                          f"indices (0, 1, ...), got {workers!r}")
    replicated = shard.get("replicated", False)
    if not isinstance(replicated, bool):
        raise ConfigError(f"{where}, key 'shard.replicated': expected true or false")
    axis = shard.get("axis")
    if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
        raise ConfigError(f"{where}, key 'shard.axis': expected an integer, got {axis!r}")
    if replicated and axis is not None:
        raise ConfigError(f"{where}, key 'shard.replicated': a signal is either sharded along "
                          "an axis or replicated, not both")
    if not replicated and axis is None and len(workers) > 1:
        raise ConfigError(f"{where}, key 'shard.axis': several workers need an axis to shard "
                          "along, or replicated: true")
    backward = body.get("backward")
    if backward is not None and not isinstance(backward, str):
        raise ConfigError(f"{where}, key 'backward': expected a signal name")
    compile_ = body.get("compile", False)
    if not isinstance(compile_, bool):
        raise ConfigError(f"{where}, key 'compile': expected true or false")
    return Signal(name, source, tuple(workers), None if replicated else axis, backward, compile_)
