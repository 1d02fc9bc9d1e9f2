"""The bench scripts are not imported by any other test, so a syntax error in one goes unnoticed until
someone runs it (bench_prefill_vllm.py once would not start). Each must at least compile."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for folder in ("bench", "tools") for p in (ROOT / folder).glob("*.py"))


def test_there_are_scripts():
    assert len(SCRIPTS) >= 20


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_compiles(path: Path):
    compile(path.read_text(), str(path), "exec")
