"""The package's shape, checked: walshkv's modules import downward only (docs/architecture.md).

The import graph is built with ``ast`` over ``src/walshkv`` (and ``research/`` for cycles). A test fails on
any cycle, on an import that goes up the layer table below, and on any walshkv import inside a function
body: those hide cycles. Allowed: imports under ``if TYPE_CHECKING:`` (types only, never executed), and
function-level imports of optional third-party packages (they are not walshkv's).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "walshkv"

# Bottom to top. A module may import modules of its own layer or of any layer below it, never above.
# Keep this table and the diagram in docs/architecture.md the same.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "walshkv._version",
        "walshkv.constants",
        "walshkv.defaults",
        "walshkv.fileio",
        "walshkv.identity",
    ),  # names, protocol defaults, atomic files, a model's identity: imports nothing of walshkv
    ("walshkv.ops",),  # pure math on tensors
    ("walshkv.codecs",),  # codecs, wrappers, registry, spec grammar, the calibration protocol
    ("walshkv.export",),  # GGUF files other tools read (K mean, eq+ transforms)
    ("walshkv.presets", "walshkv.shipped"),  # the preset table and its resolution; the shipped calibrations
    ("walshkv.attention",),  # decode/prefill attention over packed codes: reference, chunked, CPU, Triton
    ("walshkv.cache",),  # the only code that touches transformers' cache API
    ("walshkv.data", "walshkv.models"),  # texts and token windows; models from PyPI packages
    ("walshkv.calibration", "walshkv.preset_file"),  # K/V statistics from text; a preset's calibration file
    ("walshkv.eval",),  # harness, metrics, reports, sweeps, pareto, rate-distortion
    ("walshkv.recommend", "walshkv.bench", "walshkv.integrations"),  # preset search; benchmarks; LMCache, Ray
    ("walshkv.cli",),  # one module per command
    ("walshkv",),  # the package facade (walshkv/__init__.py) may re-export anything
)


def _layer_of(module: str) -> int:
    best = None
    for rank, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[1]):
                best = (rank, len(name))
    if best is None:
        raise AssertionError(f"{module} is in no layer of LAYERS (tests/test_architecture.py): add it")
    return best[0]


def _module_name(path: Path, root: Path, package: str) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [package, *rel.parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """Collects (imported module, line, in_function) for one file, skipping ``if TYPE_CHECKING:`` blocks."""

    def __init__(self, module: str, is_package: bool, known: set[str]) -> None:
        self.module, self.is_package, self.known = module, is_package, known
        self.found: list[tuple[str, int, bool]] = []
        self._depth = 0

    def _function(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function  # noqa: N815 (ast.NodeVisitor names)

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _add(self, target: str, line: int) -> None:
        self.found.append((target, line, self._depth > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve(node, self.module, self.is_package)
        for alias in node.names:  # `from walshkv.codecs import spec` imports the submodule spec
            sub = f"{base}.{alias.name}"
            self._add(sub if sub in self.known else base, node.lineno)


def _graph(root: Path, package: str) -> dict[str, list[tuple[str, int, bool]]]:
    files = {p: _module_name(p, root, package) for p in sorted(root.rglob("*.py"))}
    known = set(files.values())
    out: dict[str, list[tuple[str, int, bool]]] = {}
    for path, module in files.items():
        visitor = _Imports(module, path.name == "__init__.py", known)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        out[module] = [(t, line, fn) for t, line, fn in visitor.found if t == package or t.startswith(package + ".")]
    return out


def _owner(target: str, known: set[str]) -> str:
    """The module that an import of ``target`` executes (``walshkv.codecs.Codec`` -> ``walshkv.codecs``)."""
    while target not in known and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def _cycles(graph: dict[str, list[tuple[str, int, bool]]]) -> list[list[str]]:
    known = set(graph)
    edges = {m: sorted({_owner(t, known) for t, _, _ in deps} - {m}) for m, deps in graph.items()}
    for m in list(edges):  # importing a.b runs a/__init__.py first; that edge is implied, not a cycle
        edges[m] = [t for t in edges[m] if not m.startswith(t + ".")]
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, []):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


GRAPH = _graph(SRC, "walshkv")


def test_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []


def test_no_walshkv_import_inside_a_function() -> None:
    bad = [f"{m}:{line} imports {t}" for m, deps in GRAPH.items() for t, line, fn in deps if fn]
    assert bad == [], "move these imports to module level (or under TYPE_CHECKING for types):\n" + "\n".join(bad)


def test_imports_go_downward() -> None:
    known = set(GRAPH)
    bad = []
    for module, deps in GRAPH.items():
        own = _layer_of(module)
        for target, line, _ in deps:
            target = _owner(target, known)
            if target == "walshkv" or module.startswith(target + "."):
                continue  # the package itself (its __init__ runs anyway) and a module's own parents
            if _layer_of(target) > own:
                bad.append(f"{module}:{line} imports {target} (layer {_layer_of(target)} > {own})")
    assert bad == [], "imports that go up a layer (see LAYERS):\n" + "\n".join(bad)


def test_every_module_has_a_layer() -> None:
    for module in GRAPH:
        _layer_of(module)


@pytest.mark.parametrize("where", ["research"])
def test_research_has_no_cycles(where: str) -> None:
    root = ROOT / where / "walshkv_research"
    if not root.is_dir():
        pytest.fail(f"{root} is missing: research code lives outside the package (docs/architecture.md)")
    assert _cycles(_graph(root, "walshkv_research")) == []
