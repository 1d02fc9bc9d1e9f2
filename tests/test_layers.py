"""pyengine's modules form layers, each importing only from its own layer and the ones below:

    types and config < ops < model < text < engine < API

Every module is assigned a layer in LAYERS (a new module must be added there). Imports are read from the
source (function-level imports included; `if TYPE_CHECKING:` blocks, which hold annotations only, left
out), so the check needs no import of the package."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top. A name matches that module and, if it is a package, everything in it; the most specific
# name wins (pyengine.engine.async_engine is API although pyengine.engine is engine).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("types and config", ("pyengine.config", "pyengine.engine_args", "pyengine.dtypes", "pyengine.sampling_params",
                          "pyengine.output_types", "pyengine.interrupt", "pyengine.request_log",
                          "pyengine._C", "pyengine._cuda")),
    ("ops", ("pyengine.ops",)),
    ("model", ("pyengine.model",)),
    ("text", ("pyengine.gguf_tokenizer", "pyengine.tokenizer", "pyengine.structured", "pyengine.grammar_pool",
              "pyengine.grammars")),  # GGUF vocabularies
    ("engine", ("pyengine.engine", "pyengine.plan", "pyengine.metrics")),
    ("API", ("pyengine", "pyengine.llm", "pyengine.engine.async_engine", "pyengine.report")),
]

_PYX_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+c?import\s+([\w, ]+)|c?import\s+([\w.]+))", re.M)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[-1] = parts[-1].split(".")[0]  # _C.cpython-311-x86_64-linux-gnu -> _C
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(package: str = "pyengine") -> dict[str, Path]:
    """Module name -> its source; a compiled module only where no source is there (_C, _cuda)."""
    files = [p for pattern in ("*.so", "*.py", "*.pyx") for p in (ROOT / package).rglob(pattern)]
    return {_module_name(p): p for p in files}  # later patterns win


def _raw_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for each import statement; names empty for `import module`."""
    if path.suffix == ".so":
        return []
    text = path.read_text()
    if path.suffix == ".pyx":
        found = []
        for m in _PYX_IMPORT.finditer(text):
            if m.group(1):
                found.append((m.group(1), [n.strip() for n in m.group(2).split(",")]))
            else:
                found.append((m.group(3), []))
        return found
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, []) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module, [a.name for a in child.names]))
            visit(child)

    visit(ast.parse(text))
    return found


def import_graph(package: str = "pyengine") -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (`from package import module` counts as the module)."""
    modules = package_modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for module, names in _raw_imports(path):
            if module != package and not module.startswith(package + "."):
                continue
            submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            targets.update(submodules or [module])
        targets.discard(name)
        graph[name] = targets
    return graph


def layer_of(module: str) -> int:
    best, rank = "", -1
    for i, (_, names) in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".") and n != "pyengine") and len(n) > len(best):
                best, rank = n, i
    return rank


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_every_module_has_a_layer():
    assert [m for m in sorted(package_modules()) if layer_of(m) < 0] == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []
    assert cycles(import_graph("server")) == []


def test_no_module_imports_from_a_layer_above():
    upward = sorted((m, t) for m, targets in import_graph().items() for t in targets if layer_of(t) > layer_of(m))
    assert upward == [], [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
                          for m, t in upward]


def test_the_checker_sees_function_level_imports_and_skips_annotation_ones():
    graph = import_graph()
    assert "pyengine.model.loader" in graph["pyengine.plan"]  # imported inside plan.main()
    assert "pyengine.engine.request" not in graph["pyengine.output_types"]  # under TYPE_CHECKING
    assert "pyengine._C" in graph["pyengine.ops._common"]  # `from pyengine import _C`
    assert {"pyengine.engine.block_pool", "pyengine.engine.request"} <= graph["pyengine.engine.scheduler"]


def test_server_modules_do_not_import_a_program_entry_point():
    """`python -m server` runs server/__main__.py; the modules share server/cli.py instead."""
    assert [m for m, targets in import_graph("server").items() if "server.__main__" in targets] == []
