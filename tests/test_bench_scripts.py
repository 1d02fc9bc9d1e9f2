"""The bench scripts are not imported by any other test, so a syntax error or a stale import in one goes
unnoticed until someone runs it. Each must compile, and each `bench.*` module it imports must exist."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for folder in ("bench", "tools") for p in (ROOT / folder).rglob("*.py"))


def test_there_are_scripts():
    assert len(SCRIPTS) >= 20


def test_bench_top_level_holds_only_the_readme():
    """Scripts live in folders by purpose (kernels/, engine/, serve/, compare/, lab/, gpu/)."""
    assert sorted(p.name for p in (ROOT / "bench").iterdir() if p.is_file()) == ["README.md"]


def test_bench_readme_lists_every_script():
    readme = (ROOT / "bench" / "README.md").read_text()
    scripts = [p for p in (ROOT / "bench").rglob("*") if p.suffix in (".py", ".cpp", ".sh") and p.parent.name != "common"]
    missing = [str(p.relative_to(ROOT / "bench")) for p in scripts if str(p.relative_to(ROOT / "bench")) not in readme]
    assert not missing, f"bench/README.md does not list {missing}"


def bench_imports(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bench":
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] == "bench"]
    return names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_compiles_and_its_bench_imports_exist(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    compile(tree, str(path), "exec")
    for name in bench_imports(tree):
        parts = name.split(".")
        # a module (a file or a folder), or a name defined in one
        found = any(ROOT.joinpath(*parts[:n]).with_suffix(".py").exists() or ROOT.joinpath(*parts[:n]).is_dir()
                    for n in (len(parts), len(parts) - 1) if n > 1)
        assert found, f"{path.relative_to(ROOT)} imports {name}, which is not in bench/"
