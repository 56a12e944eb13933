"""The benchmark scripts run outside the suite (bench/, each `python bench/X.py`), and share helpers by importing
from one another (`from clock import cpu_model`): every name a script imports from a sibling must be defined there, so
that moving or renaming a helper cannot break a benchmark silently (it once broke seven)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def test_every_name_a_benchmark_imports_from_a_sibling_exists():
    scripts = {path.stem: ast.parse(path.read_text()) for path in sorted(BENCH.glob("*.py"))}
    defined = {name: top_level_names(tree) for name, tree in scripts.items()}
    missing = [f"bench/{name}.py:{node.lineno}: {node.module}.{alias.name}"
               for name, tree in scripts.items() for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in scripts
               for alias in node.names if alias.name not in defined[node.module]]
    assert sum(isinstance(n, ast.ImportFrom) and n.module in scripts for t in scripts.values() for n in ast.walk(t)) > 5
    assert missing == [], "\n".join(missing)
