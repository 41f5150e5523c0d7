"""Layers point one way: flexdemo's import graph, read from the source with ``ast`` (nothing is
imported), has no cycle between packages and no arrow up the ranks below.

Every import counts: absolute or relative, at module level or inside a function (a lazy import
is still a dependency). A package is a folder of flexdemo (``flexdemo.wire``) or a top-level
module (``flexdemo.local``). An edge may go to a lower rank, or stay within its package;
within a package, modules import each other without cycles.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent / "flexdemo"

# Lower ranks are imported by higher ones, never the reverse.
RANKS = {
    "flexdemo.local": 0,  # the local shard of a DTensor
    "flexdemo.replica_group": 0,  # the ReplicaGroup protocol and its static implementation: torch only
    "flexdemo.wire": 0,  # DCT, bit packing, the payload format: torch and stdlib only
    "flexdemo.kernels": 1,  # Triton kernels writing and reading the wire
    "flexdemo.data": 1,  # corpora, tokenizers, the dataset and its resharding (no torchtitan)
    "flexdemo.compression": 2,  # torch codec, buckets, paths, exchange, agreement, TopkCompressor
    "flexdemo.replica_check": 3,  # the replicas-identical check (uses compression.exchange)
    "flexdemo.optim": 3,  # DeMo, DiLoCo
    "flexdemo.elastic": 3,  # torchft's Manager as a ReplicaGroup (nothing below imports it)
    "flexdemo.modes": 3.5,  # the mode registry: what each mode reads, checks, builds, records (no torchtitan)
    "flexdemo.run_settings": 3.6,  # what the replicas of a run agree on: the mode's tag, start-up, elastic join
    "flexdemo.section": 3.6,  # the [flexdemo] section's keys and their own checks (no torchtitan)
    "flexdemo": 4,  # flexdemo/__init__.py: the public names
    "flexdemo.titan": 4,  # the torchtitan plugin
    "flexdemo.plan": 5,  # the cluster planner: reads configs and memory estimates through the plugin
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, modules=()) -> set[str]:
    """Every module ``name`` imports: ``import a.b`` -> ``a.b``; ``from a import b`` -> ``a.b`` when
    that is one of ``modules``, else ``a`` (``b`` a name defined in ``a``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for a in node.names:
                found.add(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target)
    return found


def _graph() -> dict[str, set[str]]:
    """flexdemo module -> the flexdemo modules it imports (names that are not modules dropped)."""
    modules = _modules()
    return {name: {t for t in _imports(name, path, modules) if t in modules and t != name}
            for name, path in modules.items()}


def _package(module: str) -> str:
    """The unit of layering: a folder of flexdemo, a top-level module, or flexdemo itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _edges(graph) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets)


def _find_cycle(nodes: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph ``nodes`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(nodes.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(nodes):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _package_graph(graph) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, b in _edges(graph):
        pa, pb = _package(a), _package(b)
        if pa != pb:
            out.setdefault(pa, set()).add(pb)
    return out


def _edge_witnesses(graph, pa: str, pb: str) -> list[str]:
    return [f"{a} -> {b}" for a, b in _edges(graph) if _package(a) == pa and _package(b) == pb]


def test_every_package_has_a_rank():
    missing = sorted({_package(m) for m in _modules()} - set(RANKS))
    assert not missing, f"packages with no rank in RANKS (give each one): {missing}"


def test_no_cycle_between_packages():
    graph = _graph()
    cycle = _find_cycle(_package_graph(graph))
    assert cycle is None, "package cycle " + " -> ".join(cycle) + ": " + "; ".join(
        w for pa, pb in zip(cycle, cycle[1:]) for w in _edge_witnesses(graph, pa, pb))


def test_no_cycle_between_modules():
    cycle = _find_cycle(_graph())
    assert cycle is None, "module import cycle: " + " -> ".join(cycle)


def test_imports_point_down_the_ranks():
    upward = [f"{a} (rank {RANKS[_package(a)]}) -> {b} (rank {RANKS[_package(b)]})"
              for a, b in _edges(_graph())
              if _package(a) != _package(b) and RANKS[_package(b)] >= RANKS[_package(a)]]
    assert not upward, "imports that do not point to a lower rank:\n" + "\n".join(upward)


def test_wire_imports_nothing_of_flexdemo_but_itself():
    outside = [f"{a} -> {b}" for a, b in _edges(_graph())
               if _package(a) == "flexdemo.wire" and _package(b) != "flexdemo.wire"]
    assert not outside, "flexdemo.wire must be a leaf: " + "; ".join(outside)
    allowed = {"torch", "flexdemo", *sys.stdlib_module_names}
    third_party = sorted({f"{name} -> {t}" for name, path in _modules().items() if _package(name) == "flexdemo.wire"
                          for t in _imports(name, path) if t.split(".")[0] not in allowed})
    assert not third_party, "flexdemo.wire imports only torch and the standard library: " + "; ".join(third_party)


def test_kernels_never_import_compression():
    wrong = [f"{a} -> {b}" for a, b in _edges(_graph())
             if _package(a) == "flexdemo.kernels" and _package(b) == "flexdemo.compression"]
    assert not wrong, "flexdemo.kernels must not import flexdemo.compression: " + "; ".join(wrong)


def test_data_imports_no_torchtitan():
    wrong = sorted({f"{name} -> {t}" for name, path in _modules().items() if _package(name) == "flexdemo.data"
                    for t in _imports(name, path) if t.split(".")[0] == "torchtitan"})
    assert not wrong, "flexdemo.data must not import torchtitan: " + "; ".join(wrong)


def test_the_scan_sees_lazy_and_relative_imports():
    # The graph is only as good as the parser: a relative import and an import inside a function
    # of modules that exist today must appear as edges.
    graph = _graph()
    assert "flexdemo.titan.config" in graph["flexdemo.titan.metrics"]  # from .config import ...
    assert "flexdemo.replica_check" in graph["flexdemo.titan.replicas"]  # inside a function
