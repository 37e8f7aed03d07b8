"""The sizes the house keeps (issue 35, docs/architecture.md): the engine's step fits on one
screen, engine.py stays small enough to read in one sitting, the README stays a page for users."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lines_of(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_engine_module_stays_under_300_lines():
    assert lines_of(ROOT / "runtime" / "engine.py") <= 300


def test_the_engine_step_fits_on_one_screen():
    tree = ast.parse((ROOT / "runtime" / "engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMEngine")
    step = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "step")
    body_lines = step.end_lineno - step.body[0].lineno + 1
    assert body_lines <= 15, f"LLMEngine.step has {body_lines} lines"


def test_the_readme_stays_a_page():
    assert lines_of(ROOT / "README.md") <= 200
