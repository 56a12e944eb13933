"""Imports inside the inference stack run one way, and the model imports nothing of it.

The order (each module's docstring says it too): memory < state_quant < cache < fastpath < steps < decoder <
speculative < text < scheduler < engine < generate, server; sampling below them. Lazy imports inside functions count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hybridtron

PACKAGE = Path(hybridtron.__file__).parent
ORDER = ["memory", "state_quant", "sampling", "cache", "fastpath", "steps", "decoder", "speculative", "text",
         "scheduler", "engine", "generate", "server"]


def hybridtron_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybridtron"):
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("hybridtron"))
    return names


def test_the_model_imports_nothing_of_inference():
    for path in (PACKAGE / "model").glob("*.py"):
        offending = {name for name in hybridtron_imports(path) if name.startswith("hybridtron.infer")}
        assert not offending, f"{path.name} imports {sorted(offending)}"


def module_files(module: str) -> list[Path]:
    """A module's file, or every file of a package (infer/server/)."""
    path = PACKAGE / "infer" / module
    return sorted(path.glob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def test_inference_modules_import_only_those_below_them():
    infer = PACKAGE / "infer"
    modules = {path.stem for path in infer.glob("*.py")} - {"__init__"}
    modules |= {path.parent.name for path in infer.glob("*/__init__.py")}
    assert modules == set(ORDER), "a new infer module needs its place in ORDER"
    for module in ORDER:
        imported = {name.split(".")[2] for path in module_files(module) for name in hybridtron_imports(path)
                    if name.startswith("hybridtron.infer.") and name.split(".")[2] in modules} - {module}
        above = {other for other in imported if ORDER.index(other) >= ORDER.index(module)}
        assert not above, f"infer/{module}.py imports {sorted(above)}, which are not below it"
