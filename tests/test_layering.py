"""Imports run one way: every module of `openinfer` sits in a layer, and a module imports only from its own layer or
the layers below it, with no circle between modules (docs/architecture.md draws the same order).

The order is data (`LAYERS`, lowest first). A package sits in one layer; a module named on its own overrides its
package (the longest dotted prefix decides). Imports are read from the source with `ast`, wherever they stand in a
file (a function-level import is still a dependency), so nothing is imported to check them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "openinfer"

# lowest first, each (name, members); a module may import from its own layer and from every layer before it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("data", ("openinfer.config", "openinfer.sampling_params", "openinfer.outputs", "openinfer.request",
              "openinfer.multimodal", "openinfer.device_io", "openinfer.structured_output.params")),
    # the engine's mechanisms, each knowing nothing of models: caches, sampling, weight formats, collectives and
    # EPLB, the tokenizer, checkpoint I/O
    ("mechanisms", ("openinfer.kv_cache", "openinfer.sampling", "openinfer.quantization", "openinfer.distributed",
                    "openinfer.tokenizer", "openinfer.loader")),
    ("layers", ("openinfer.layers",)),              # kernels and the layers models are built from
    ("models", ("openinfer.models",)),              # families behind their written interface, and the registry
    ("beside the model", ("openinfer.spec_decode", "openinfer.structured_output")),   # drafters, grammars
    ("engine", ("openinfer.engine",)),              # one rank: scheduler, KV manager, runner, output processor
    ("executor", ("openinfer.executor",)),          # starting, watching and stopping ranks
    ("serving", ("openinfer.serving",)),            # HTTP, protocols, router, balancers
    ("offline API", ("openinfer.entrypoints.llm",)),
    # tooling beside the runtime path: cluster simulation and autoscaling policy, checkpoint writers, training,
    # benchmarks
    ("tooling", ("openinfer.cluster", "openinfer.tools", "openinfer.benchmarks")),
    ("entry points", ("openinfer.entrypoints", "openinfer.__main__", "openinfer")),   # the CLI, package exports
]


def layer_of(module: str) -> int:
    best, layer = -1, None
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, layer = len(name), i
    if layer is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layering.py: add its package to LAYERS")
    return layer


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> list[tuple[str, int]]:
    """(imported openinfer module, line) for every import statement in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "openinfer"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "openinfer":
                continue
            # `from pkg import mod` imports the module pkg.mod when there is one
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((sub if _is_module(sub) else base, node.lineno))
    return found


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _graph(root: Path = PACKAGE) -> dict[str, list[tuple[str, int]]]:
    return {module_name(p): imports_of(p, module_name(p)) for p in sorted(root.rglob("*.py"))}


def upward_imports(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    bad = []
    for module, deps in graph.items():
        deps = sorted(set(deps), key=lambda d: (d[1], d[0]))
        own = layer_of(module)
        path = module.replace(".", "/")
        for dep, line in deps:
            if layer_of(dep) > own:
                bad.append(f"{path}.py:{line} imports {dep}: layer '{LAYERS[layer_of(dep)][0]}' is above "
                           f"layer '{LAYERS[own][0]}'")
    return bad


def circles(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Every import circle between modules, as 'a -> b -> a' (a module's own package __init__ excluded: importing
    `pkg.mod` runs `pkg/__init__.py` first, which is not a dependency the module chose)."""
    edges = {m: sorted({d for d, _ in deps if d in graph and d != m}) for m, deps in graph.items()}
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:       # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(" -> ".join(sorted(component)))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    for module in _graph():
        layer_of(module)


def test_imports_run_one_way():
    bad = upward_imports(_graph())
    assert not bad, "imports that run upward:\n" + "\n".join(bad)


def test_no_import_circles():
    found = circles(_graph())
    assert not found, "import circles:\n" + "\n".join(found)


def test_the_check_fails_on_an_upward_import_and_a_circle(tmp_path):
    """The checks above can fail: a model module importing the engine, and two modules importing each other."""
    pkg = tmp_path / "openinfer"
    for sub in ("models", "engine", "kv_cache"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "llama.py").write_text("import torch\nfrom openinfer.engine.scheduler import Scheduler\n")
    (pkg / "engine" / "scheduler.py").write_text("from openinfer.kv_cache import pool\n")
    (pkg / "kv_cache" / "pool.py").write_text("from openinfer.kv_cache.manager import X\n")
    (pkg / "kv_cache" / "manager.py").write_text("from . import pool\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        graph = {module_name(p): imports_of(p, module_name(p)) for p in sorted(pkg.rglob("*.py"))}
        bad = upward_imports(graph)
        found = circles(graph)
    finally:
        ROOT = saved
    assert bad == ["openinfer/models/llama.py:2 imports openinfer.engine.scheduler: layer 'engine' is above layer "
                   "'models'"]
    assert found == ["openinfer.kv_cache.manager -> openinfer.kv_cache.pool"]


@pytest.mark.parametrize("module", ["openinfer.models.registry", "openinfer.engine.llm_engine"])
def test_a_module_named_in_the_order_is_known(module):
    assert 0 <= layer_of(module) < len(LAYERS)
