"""Dependencies point one way: user API over client over dispatcher and worker over transport,
with ops, placement, trace recording and errors at the bottom. Checked on every import in
gtmpi's source, those inside functions included."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gtmpi"
# lower number: lower layer; a module may import its own layer and those below
LAYERS = {
    "errors": 0, "ops": 0, "placement": 0, "recording": 0, "transport": 0, "signals.config": 0,
    "monitor": 0,
    "dispatcher": 1, "worker": 1,
    "client": 2, "autograd": 2,
    "nn": 3, "optim": 3, "signals": 3, "trace": 3, "debug": 3, "checkpoint": 3, "sharded": 3,
    "launch": 3,
    "cli": 3, "pipeline": 3, "cuda": 3, "interop": 3, "amp": 3, "backends": 3, "utils": 3,
    "profiler": 3,
    "server": 3, "__init__": 3, "__main__": 3,
}


def _part(module: str) -> str:
    """The layer key of a dotted module name inside gtmpi ('gtmpi.worker.loop' -> 'worker');
    entry points (``python -m``) are programs, at the top."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return "__main__"
    if ".".join(parts[1:3]) in LAYERS:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[str, int]]:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    here = list(rel.parts)
    if here[-1] == "__init__":
        here = here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("gtmpi")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative to this module's package
                package = here if path.name == "__init__.py" else here[:-1]
                base = package[:len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                if not node.module:  # from . import x, y: each is a module of that package
                    found += [(f"{target}.{a.name}", node.lineno) for a in node.names]
                    continue
            else:
                target = node.module or ""
            if target.startswith("gtmpi"):
                found.append((target, node.lineno))
    return found


def test_no_module_imports_a_layer_above_its_own():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        mine = LAYERS[_part(".".join(rel.parts))]
        for target, line in _imports(path):
            if LAYERS[_part(target)] > mine:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_worker_never_reaches_the_client():
    """Transitively: what a worker process imports never includes the client or user API."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        graph[name] = {t for t, _ in _imports(path)}
    seen, todo = set(), ["gtmpi.worker.loop", "gtmpi.worker.executor", "gtmpi.worker.child",
                         "gtmpi.dispatcher.dispatcher", "gtmpi.dispatcher.placer"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [t for t in graph.get(name, ()) if t in graph]
    assert {_part(m) for m in seen} <= {k for k, v in LAYERS.items() if v <= 1}, sorted(seen)


def test_the_session_and_its_embedded_start_import_one_way():
    """client/embedded imports client/runtime (it makes a Runtime); the runtime reaches the
    embedded default only through the starter embedded registers, never by importing it."""
    runtime = {t for t, _ in _imports(PACKAGE / "client" / "runtime.py")}
    embedded = {t for t, _ in _imports(PACKAGE / "client" / "embedded.py")}
    assert "gtmpi.client.runtime" in embedded
    assert not any(t.startswith("gtmpi.client.embedded") for t in runtime), runtime


def test_autograd_sits_over_the_client_and_not_beside_it():
    """autograd imports the client (its tensors, creation, runtime); the client reaches
    autograd only through what autograd registers (client/gradmode.py), never by import."""
    engine = {t for t, _ in _imports(PACKAGE / "autograd" / "engine.py")}
    assert "gtmpi.client.tensor" in engine and "gtmpi.client.gradmode" in engine
    wrong = [f"{path.name}:{line} imports {target}"
             for path in sorted((PACKAGE / "client").glob("*.py"))
             for target, line in _imports(path) if target.startswith("gtmpi.autograd")]
    assert not wrong, wrong


def test_no_import_circle_among_gtmpi_modules():
    """No module reaches itself through what it imports, lazy imports included: client/tensor
    makes tensors from values itself rather than through client/creation, which builds on it."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        graph[".".join(p for p in rel.parts if p != "__init__")] = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        for target, _ in _imports(path):
            # 'from .x import y' names y in x: a module of x's package, or a name x defines
            module = target if target in graph else target.rsplit(".", 1)[0]
            if module in graph and module != name and module != "gtmpi":
                graph[name].add(module)
    circles = []
    for start in sorted(graph):
        todo, seen = list(graph[start]), set()
        while todo:
            name = todo.pop()
            if name == start:
                circles.append(start)
                break
            if name not in seen:
                seen.add(name)
                todo += graph[name]
    assert not circles, circles


def test_every_public_function_has_type_hints():
    """Module-level functions and public classes' methods not named with a leading underscore
    annotate every argument and their result."""
    bare = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        fns += [f for c in tree.body if isinstance(c, ast.ClassDef) and not c.name.startswith("_")
                for f in c.body if isinstance(f, ast.FunctionDef)]
        for f in fns:
            a = f.args
            args = [x for x in a.posonlyargs + a.args + a.kwonlyargs
                    if x.arg not in ("self", "cls")]
            args += [x for x in (a.vararg, a.kwarg) if x is not None]
            if not f.name.startswith("_") and (f.returns is None or
                                               any(x.annotation is None for x in args)):
                bare.append(f"{path.relative_to(PACKAGE.parent)}:{f.lineno} {f.name}")
    assert not bare, "\n".join(bare)
