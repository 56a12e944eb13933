"""The import contract: dependencies run one way,

    config, errors, files < ops < model < numerics < checkpoint < data < envs < distributed < train, infer
    < eval, deploy < post < recipe, experiments < cli

A module may import its own layer and the layers below, at module level or inside a function alike; train and
infer, side by side, never import each other, and neither do eval and deploy, or recipe and experiments.
distributed is one layer, below train: its runtime (mesh, parallelize, the TP / EP / CP / PP pieces) and its planner (`hybridtron plan`, pure
arithmetic over the model config) and `hybridtron convert` (checkpoint formats) need nothing above it.

Beyond the order: no import cycle between the package's modules (function-local imports included: a cycle hidden
in a function still ties two modules into one; a submodule import runs its package's __init__ first, so that is an
edge too), no private name (`_x`) imported from another module, and at most MAX_LOCAL_IMPORTS function-local imports
of the package's own modules (each command module is a library that imports at its top; what stays lazy is the
CLI's registry and optional dependencies). Imports under `if TYPE_CHECKING:` are for annotations only and never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hybridtron

PACKAGE = Path(hybridtron.__file__).parent
LAYERS = [("config", "errors", "files"), ("ops",), ("model",), ("numerics",), ("checkpoint",), ("data",), ("envs",),
          ("distributed",), ("train", "infer"), ("eval", "deploy"), ("post",), ("recipe", "experiments"), ("cli", "__main__")]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
SIDE_BY_SIDE = {("train", "infer"), ("infer", "train"), ("eval", "deploy"), ("deploy", "eval"),
                ("recipe", "experiments"), ("experiments", "recipe")}
MAX_LOCAL_IMPORTS = 60  # 241 before the run scaffold (issue 38)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("hybridtron",) + parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> str | None:
    """`hybridtron.train.loop` -> `train`; the package root itself belongs to no layer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def type_checking_lines(tree: ast.AST) -> set[int]:
    """The lines of `if TYPE_CHECKING:` blocks."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def function_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def imports_of(path: Path) -> list[tuple[int, str, list[str], bool]]:
    """(line, module imported, names imported from it, inside a function) for each import of a hybridtron module
    that runs (TYPE_CHECKING blocks left out)."""
    module = module_name(path)
    tree = ast.parse(path.read_text())
    skipped, local = type_checking_lines(tree), function_lines(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.lineno in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, [], node.lineno in local) for alias in node.names]
            continue
        base = node.module
        if node.level:  # relative: resolve against this module's package
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        if base:
            found.append((node.lineno, base, [alias.name for alias in node.names], node.lineno in local))
    return [entry for entry in found if entry[1].split(".")[0] == "hybridtron"]


def import_edges() -> dict[str, set[str]]:
    """module -> the package modules its imports run: the module itself, every package __init__ on the way (but the
    module's own packages', which are being imported already when it runs), and a submodule named by
    `from package import submodule`."""
    edges: dict[str, set[str]] = {module: set() for module in MODULES}
    for module, path in MODULES.items():
        for _, target, names, _ in imports_of(path):
            parts = target.split(".")
            for end in range(2, len(parts) + 1):
                prefix = ".".join(parts[:end])
                inside = module.startswith(prefix + ".")
                if prefix in MODULES and prefix != module and (not inside or prefix == target):
                    edges[module].add(prefix)
            for name in names:
                if f"{target}.{name}" in MODULES:
                    edges[module].add(f"{target}.{name}")
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


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
        for line, target, _, _ in imports_of(path):
            other = layer_of(target)
            if other is None or other == own:
                continue
            if RANK[other] > RANK[own] or (own, other) in SIDE_BY_SIDE:
                violations.append(f"{relative}:{line} ({own}) imports {target} ({other})")
    assert not violations, "imports against the layer order:\n" + "\n".join(violations)


def test_no_import_cycle():
    cycle = find_cycle(import_edges())
    assert cycle is None, "an import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_private_name_is_imported_from_another_module():
    violations = []
    for module, path in sorted(MODULES.items()):
        for line, target, names, _ in imports_of(path):
            private = [name for name in names if name.startswith("_") and not name.startswith("__")]
            if private and target != module:
                violations.append(f"{path.relative_to(PACKAGE)}:{line} imports {', '.join(private)} from {target}")
    assert not violations, "private names imported across modules:\n" + "\n".join(violations)


def test_function_local_imports_of_the_package_stay_few():
    local = [f"{path.relative_to(PACKAGE)}:{line} {target}" for path in sorted(PACKAGE.rglob("*.py"))
             for line, target, _, inside in imports_of(path) if inside]
    assert len(local) <= MAX_LOCAL_IMPORTS, (f"{len(local)} function-local imports of hybridtron modules (at most "
                                             f"{MAX_LOCAL_IMPORTS}); import at the module's top:\n" + "\n".join(local))
