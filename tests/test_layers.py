"""The import contract: dependencies run one way,

    config, errors, files < ops < model < numerics < checkpoint < data < dist < train, infer < post < experiments < cli

A module may import its own layer and the layers below, at module level or inside a function alike; train and
infer, side by side, never import each other. A lower layer importing a higher one fails here, naming both."""

from __future__ import annotations

import ast
from pathlib import Path

import hybridtron

PACKAGE = Path(hybridtron.__file__).parent
LAYERS = [("config", "errors", "files"), ("ops",), ("model",), ("numerics",), ("checkpoint",), ("data",), ("dist",),
          ("train", "infer"), ("post",), ("experiments",), ("cli", "__main__")]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
SIDE_BY_SIDE = {("train", "infer"), ("infer", "train")}  # one rank, and still independent


def layer_of(module: str) -> str | None:
    """`hybridtron.train.loop` -> `train`; the package root itself belongs to no layer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def imports_of(path: Path) -> list[tuple[int, str]]:
    module = "hybridtron." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[:-node.level] if path.name != "__init__.py" else \
                    module.split(".")[:len(module.split(".")) - node.level + 1]
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            elif node.module:
                found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.split(".")[0] == "hybridtron"]


def test_every_module_belongs_to_a_layer():
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if parts == ("__init__.py",):
            continue
        name = parts[0].removesuffix(".py")
        assert name in RANK, f"{path.relative_to(PACKAGE)}: not in any layer of the import contract"


def test_imports_only_go_down():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts == ("__init__.py",):
            continue
        own = relative.parts[0].removesuffix(".py")
        for line, target in imports_of(path):
            other = layer_of(target)
            if other is None or other == own:
                continue
            if RANK[other] > RANK[own] or (own, other) in SIDE_BY_SIDE:
                violations.append(f"{relative}:{line} ({own}) imports {target} ({other})")
    assert not violations, "imports against the layer order:\n" + "\n".join(violations)
