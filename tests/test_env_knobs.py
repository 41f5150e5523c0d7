"""The library reads only documented environment variables: every os.environ / os.getenv read in
flexdemo/ names one of ALLOWED by a string literal, and docs/config.md documents each. Kernel choices
that change bits are config keys in the start-up agreement, never environment switches."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "flexdemo"

ALLOWED = {
    "FLEXDEMO_CACHE",  # flexdemo.data: where the offline corpora and tokenizers are built
    "NPROC", "NNODES",  # flexdemo.titan.launch, from scripts/launch.sh
    "OMP_NUM_THREADS", "PYTHONUNBUFFERED",  # set by flexdemo.titan.launch for CPU ranks where unset
    "CUDA_VISIBLE_DEVICES",  # CUDA's own: flexdemo.titan.launch reads whether it hides every GPU
    "RANK", "WORLD_SIZE", "TORCHELASTIC_ERROR_FILE",  # set by torchrun
    "TRITON_INTERPRET", "TRITON_CACHE_DIR",  # Triton's own settings
    "TORCHFT_LIGHTHOUSE",  # torchft's own: the Lighthouse of elastic replicas
    "TORCHFT_QUORUM_TIMEOUT_SEC",  # torchft's own: how long a replica waits for a quorum
}
# The A/B switches and the launcher-only assets variable this replaced: never read again.
REMOVED = {"FLEXDEMO_TOPK_BRACKET", "FLEXDEMO_FUSED_WARPS", "FLEXDEMO_ENCODE_MAXNREG",
           "FLEXDEMO_DECODE_MAXNREG", "FLEXDEMO_GROUPED_HINTS", "FLEXDEMO_ASSETS"}


def _env_reads(source: str, where: str) -> tuple[set[str], list[str]]:
    """(the variable names read by literal, the reads that name none: whole-environment uses or
    computed names, as 'file:line what')."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    # `from os import environ, getenv` (any alias) as well as `os.environ` / `os.getenv`.
    aliases = {a.asname or a.name: a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and node.module == "os" for a in node.names if a.name in ("environ", "getenv")}
    names, opaque = set(), []

    def key_of(expr) -> str | None:
        return expr.value if isinstance(expr, ast.Constant) and isinstance(expr.value, str) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                isinstance(node.value, ast.Name) and node.value.id == "os":
            kind = node.attr
        elif isinstance(node, ast.Name) and node.id in aliases and isinstance(node.ctx, ast.Load):
            kind = aliases[node.id]
        else:
            continue
        parent, key, line = parents.get(node), None, f"{where}:{node.lineno}"
        if kind == "getenv":
            if isinstance(parent, ast.Call) and parent.func is node and parent.args:
                key = key_of(parent.args[0])
        elif isinstance(parent, ast.Subscript) and parent.value is node:
            key = key_of(parent.slice)
        elif isinstance(parent, ast.Attribute) and parent.attr in ("get", "pop", "setdefault"):
            call = parents.get(parent)
            if isinstance(call, ast.Call) and call.func is parent and call.args:
                key = key_of(call.args[0])
        elif isinstance(parent, ast.Compare) and node in parent.comparators:
            key = key_of(parent.left)
        if key is None:
            opaque.append(f"{line} {ast.unparse(parent or node)[:80]}")
        else:
            names.add(key)
    return names, opaque


def library_env_reads() -> tuple[dict[str, list[str]], list[str]]:
    reads: dict[str, list[str]] = {}
    opaque: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(REPO))
        names, unknown = _env_reads(path.read_text(encoding="utf-8"), where)
        for name in names:
            reads.setdefault(name, []).append(where)
        opaque += unknown
    return reads, opaque


def test_the_library_reads_only_allowed_environment_variables():
    reads, opaque = library_env_reads()
    assert not opaque, f"environment reads that name no variable: {opaque}"
    unknown = {name: files for name, files in reads.items() if name not in ALLOWED}
    assert not unknown, (f"undocumented environment variables read by the library: {unknown}; "
                         "make it a config key, or document it in docs/config.md's Environment section and ALLOWED")
    assert not REMOVED & set(reads)
    assert {"FLEXDEMO_CACHE", "TRITON_INTERPRET"} <= set(reads)  # the scan finds reads at all


def _section(doc: str, heading: str) -> str:
    """The text under the level-2 heading ``## heading`` up to the next level-2 heading."""
    assert f"\n## {heading}\n" in doc, f"docs/config.md has no '## {heading}' section"
    return doc.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_every_allowed_variable_is_documented_in_the_config_docs():
    doc = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    section = _section(doc, "Environment")
    missing = sorted(name for name in ALLOWED if f"`{name}`" not in section)
    assert not missing, f"docs/config.md's Environment section does not document {missing}"
    offline = _section(doc, "Offline data")
    assert "`FLEXDEMO_ASSETS`" in offline and "removed" in offline, "docs/config.md must say FLEXDEMO_ASSETS was removed"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "docs/config.md" in readme, "README.md must link the configuration page"


def test_the_scan_sees_every_form_of_read():
    src = """
import os
from os import environ as env, getenv
a = os.environ.get("A", "0")
b = os.environ["B"]
c = "C" in os.environ
d = getenv("D")
e = env.get("E")
f = os.getenv("F")
g = os.environ.get(name)
h = dict(os.environ)
os.environ.setdefault("I", "1")
"""
    names, opaque = _env_reads(src, "x.py")
    assert names == {"A", "B", "C", "D", "E", "F", "I"}
    assert sorted(o.split()[0] for o in opaque) == ["x.py:10", "x.py:11"]
