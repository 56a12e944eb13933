"""Imports inside the inference stack run one way, and the model imports nothing of it.

The order (each module's docstring says it too): state_quant < cache < fastpath < steps < decoder < speculative <
text < scheduler < engine < generate, server; sampling and memory below them. Lazy imports inside functions count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hybridtron

PACKAGE = Path(hybridtron.__file__).parent
ORDER = ["state_quant", "sampling", "memory", "cache", "fastpath", "steps", "decoder", "speculative", "text",
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


def test_inference_modules_import_only_those_below_them():
    modules = {path.stem for path in (PACKAGE / "infer").glob("*.py")} - {"__init__"}
    assert modules == set(ORDER), "a new infer module needs its place in ORDER"
    for module in ORDER:
        imported = {name.split(".")[2] for name in hybridtron_imports(PACKAGE / "infer" / f"{module}.py")
                    if name.startswith("hybridtron.infer.") and name.split(".")[2] in modules}
        above = {other for other in imported if ORDER.index(other) >= ORDER.index(module)}
        assert not above, f"infer/{module}.py imports {sorted(above)}, which are not below it"
