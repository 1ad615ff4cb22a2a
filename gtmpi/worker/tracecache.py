"""Compiled programs' traces kept on disk, so that a second run of the same program skips its
trace as it skips Inductor's compile.

Inductor keeps what it compiles in its cache on disk, found by the traced graph; but the trace
that makes the graph (make_fx over fake tensors through every instruction, worker/compiled.py)
ran again in every run: on GPT-2 small's step, 4.7 s of a warm run's 9.1 s to compile (one
H100, benchmarks/RESULTS.md). Here the graph is kept, beside Inductor's cache (its folder,
TORCHINDUCTOR_CACHE_DIR), under a key of all the trace reads: the parts the caller gives (the
program's instructions, its inputs' layouts, shapes, strides, dtypes, devices and aliasing),
torch's version and gtmpi's own source (a changed kernel is a new key). GTMPI_TRACE_CACHE=0
traces every time.

A graph is kept as its nodes, not as torch.fx pickles a GraphModule (its code, traced again
when read back: that runs the code's factory calls, and the slices of an ``empty`` the program
fills became constants of the graph, read uninitialised).
"""
from __future__ import annotations

import functools
import hashlib
import operator
import os
import pickle
import tempfile
from typing import Any

import torch
from torch.fx.node import map_aggregate


def enabled() -> bool:
    return os.environ.get("GTMPI_TRACE_CACHE", "1") != "0"


def key(parts: Any) -> str | None:
    """The key of a trace of ``parts`` (anything pickle takes, the same bytes for the same
    trace), or None where they cannot be pickled."""
    try:
        data = pickle.dumps(parts, protocol=4)
    except Exception:  # an instruction's constant no pickle takes: traced every time
        return None
    return hashlib.sha256(_gtmpi_source().encode() + torch.__version__.encode() +
                          data).hexdigest()


def load(found_by: str) -> Any | None:
    """What ``store`` kept under the key, or None (none kept, or unreadable: traced again)."""
    try:
        with open(_path(found_by), "rb") as f:
            return pickle.load(f)
    except Exception:
        return None


def store(found_by: str, value: Any) -> Any:
    """Keep ``value`` under the key, written whole or not at all (a rename): a run killed
    meanwhile, or another worker writing the same key, leaves no half file. Returns it as
    ``load`` will give it back."""
    data = pickle.dumps(value, protocol=4)
    path = _path(found_by)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".writing-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:  # a full or read-only disk: the next run traces again
        pass
    return pickle.loads(data)


class _Node:
    """A reference to an earlier node of a kept graph, by its name (no tuple: map_aggregate
    would walk into one)."""
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple:
        return _Node, (self.name,)


def portable_graph(traced: torch.fx.GraphModule) -> tuple[list[tuple], dict[str, Any]]:
    """A traced graph of aten ops as pickle can keep it: each node's kind, name, target (an
    op by its schema's name and overload) and arguments (a node as _Node), and the tensors
    its get_attr nodes read. ValueError for a target that is no aten-style op."""
    nodes = []
    for node in traced.graph.nodes:
        target = node.target
        if node.op in ("placeholder", "get_attr", "output"):
            target = ("name", target)
        elif isinstance(target, torch._ops.OpOverload):
            target = ("op", target._schema.name, target._overloadname)
        elif target is operator.getitem:
            target = ("getitem",)
        else:
            raise ValueError(f"no kept form for the graph's {target!r}")
        refer = functools.partial(map_aggregate, fn=lambda a: _Node(a.name)
                                  if isinstance(a, torch.fx.Node) else a)
        nodes.append((node.op, node.name, target, refer(node.args), refer(node.kwargs)))
    constants = {node.target: getattr(traced, node.target) for node in traced.graph.nodes
                 if node.op == "get_attr"}
    return nodes, constants


def graph_module(kept: tuple[list[tuple], dict[str, Any]]) -> torch.fx.GraphModule:
    """The graph ``portable_graph`` was given, made again node by node (same names, so the
    same code)."""
    nodes, constants = kept
    root = torch.nn.Module()
    for name, value in constants.items():
        setattr(root, name, value)
    graph = torch.fx.Graph()
    made: dict[str, torch.fx.Node] = {}
    for kind, name, target, args, kwargs in nodes:
        if target[0] == "name":
            target = target[1]
        elif target[0] == "op":
            space, op = target[1].split("::")
            target = getattr(getattr(getattr(torch.ops, space), op), target[2])
        else:
            target = operator.getitem
        back = functools.partial(map_aggregate, fn=lambda a: made[a.name]
                                 if type(a) is _Node else a)
        made[name] = graph.create_node(kind, target, back(args), back(kwargs), name=name)
    return torch.fx.GraphModule(root, graph)


def _path(found_by: str) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return os.path.join(cache_dir(), "gtmpi-traces", found_by[:2], found_by + ".pickle")


@functools.cache
def _gtmpi_source() -> str:
    """gtmpi's source files hashed (once a process: about 100 files)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                digest.update(os.path.relpath(os.path.join(folder, name), root).encode())
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()
