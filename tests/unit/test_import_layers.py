"""Imports run one way (docs/architecture.md, Packages and import layers): a module imports
its own layer or lower ones, never a higher one. Checked by walking every import
statement of the four packages, those inside functions included."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "target_gpu", "draft_cpu", "speculators")

# layer of each module (the longest matching prefix wins)
LAYERS = {
    "runtime": 0,  # core types, sampling, the block manager, models, platform
    "runtime.__init__": 4,  # `from runtime import LLM`: the package's front door, loaded lazily
    "runtime.models": 0,
    "target_gpu": 1,  # executors
    "draft_cpu": 1,
    "speculators": 2,
    "runtime.config": 3,  # the engine
    "runtime.engine": 3,
    "runtime.proposer_pool": 3,
    "runtime.scheduler": 3,
    "runtime.speculation": 3,
    "runtime.llm": 3,
    "runtime.async_engine": 3,
    "runtime.serve": 4,  # front ends
    "runtime.openai_protocol": 4,
    "runtime.openai_responses": 4,
    "runtime.server_metrics": 4,
    "runtime.generate": 4,
}
OUTSIDE = ("training", "scripts", "tests", "benchmarks")  # may import anything; imported by none of the four


def layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise KeyError(module)


def module_name(path: Path) -> str:
    """The importing module's name; a package's __init__ keeps its own (runtime.__init__)."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of this project's packages in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module in PACKAGES:  # `from speculators import registry` imports speculators.registry
                names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.split(".")[0] in PACKAGES + OUTSIDE]
    return found


def source_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def resolve(name: str) -> str:
    """name, or its package when name is a member of it rather than a module."""
    while name and not ((ROOT / name.replace(".", "/")).with_suffix(".py").exists()
                        or (ROOT / name.replace(".", "/") / "__init__.py").exists()):
        name = name.rpartition(".")[0]
    return name


def test_every_module_has_a_layer():
    for path in source_files():
        layer(module_name(path))


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    importer = module_name(path)
    wrong = []
    for line, name in imports(path):
        if name.split(".")[0] in OUTSIDE:
            wrong.append(f"line {line}: {name} (outside the packages)")
            continue
        imported = resolve(name)
        if layer(imported) > layer(importer):
            wrong.append(f"line {line}: {imported} (layer {layer(imported)} > {layer(importer)})")
    assert not wrong, f"{importer} imports upward: " + "; ".join(wrong)


def test_the_walk_sees_an_upward_import(tmp_path):
    bad = ROOT / "target_gpu" / "kv_cache.py"
    source = ast.parse("from runtime.engine import LLMEngine\ndef f():\n    import runtime.serve\n")
    probe = tmp_path / "probe.py"
    probe.write_text(ast.unparse(source))
    assert [name for _, name in imports(probe)] == ["runtime.engine", "runtime.serve"]
    assert layer(resolve("runtime.engine")) > layer(module_name(bad))
