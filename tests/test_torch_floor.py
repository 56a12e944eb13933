"""pyproject's `torch>=` floor is honest: no older than the newest torch API the package uses.

Installing every old torch to try it is not possible here, so the floor is kept by a table instead: each torch API
whose availability depends on the version, the first release that has it and where that date comes from. An AST
scan of src/ finds the calls and imports that reach those APIs (through `import torch.nn.functional as F`, `from
torch import nn` and the like), and the floor must be at least the newest of them. An API guarded by `hasattr`,
with a fallback for older releases, does not raise the floor; the scan checks that the guard is there.

When new code reaches for a recent API, add it to API_SINCE with its source, and raise the floor if it needs to.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "hybridtron"


@dataclass(frozen=True)
class Api:
    name: str  # the fully qualified name the code reaches, e.g. "torch.nn.utils.get_total_norm"
    since: str  # the first torch release that has it
    keyword: str | None = None  # only calls passing this keyword argument
    positional: bool = False  # only calls passing a positional argument
    optional: bool = False  # used behind `hasattr(module, name)` with a fallback: does not raise the floor


# Sources: the PR that added each API (its merge date against the release branch cuts: 2.2 Dec 2023, 2.3 Mar 2024,
# 2.4 Jun 2024, 2.5 Sep 2024, 2.6 Dec 2024, 2.10 Dec 2025), or the release notes / docs that announce it. Private
# APIs (torch._foreach_norm, torch.distributed._functional_collectives) are not dated here.
API_SINCE = (
    # PR pytorch/pytorch#61002 (2021-08, "enable autocast support for user-specified device_type"), torch 1.10
    Api("torch.autocast", "1.10"),
    # PR pytorch/pytorch#124359 (2024-04, generalized autocast API: device_type argument), torch 2.4
    Api("torch.is_autocast_enabled", "2.4", positional=True),
    # PR pytorch/pytorch#121364 (2024-03, "Add RMSNorm module", with F.rms_norm); torch.nn.RMSNorm docs: 2.4
    Api("torch.nn.functional.rms_norm", "2.4"),
    # PR pytorch/pytorch#132689 (2024-08, "Grouped Query Attention": the enable_gqa argument), torch 2.5
    Api("torch.nn.functional.scaled_dot_product_attention", "2.5", keyword="enable_gqa"),
    # PR pytorch/pytorch#139662 (merged 2024-11-07, "Add APIs to separate norm calculation and gradient scaling")
    Api("torch.nn.utils.get_total_norm", "2.6"),
    Api("torch.nn.utils.clip_grads_with_norm_", "2.6"),
    # PyTorch 2.6 release blog (set_stance, beta) and its tutorial's "Prerequisites: torch >= 2.6"
    Api("torch.compiler.set_stance", "2.6"),
    # PR pytorch/pytorch#140251 (2024-11, "[dynamo] skip_guard_eval_unsafe stance for power users")
    Api("torch.compiler.set_stance", "2.6", keyword="skip_guard_eval_unsafe"),
    # PR pytorch/pytorch#141868 (2024-12, "[FSDP2] Move to public torch.distributed.fsdp", "targeting 2.6")
    Api("torch.distributed.fsdp.fully_shard", "2.6"),
    Api("torch.distributed.fsdp.FSDPModule", "2.6"),
    Api("torch.distributed.fsdp.MixedPrecisionPolicy", "2.6"),
    # DTensor's public namespace (torch.distributed._tensor moved; PR pytorch/pytorch#136103, 2024-09, updates the
    # docs after the move), torch 2.5
    Api("torch.distributed.tensor", "2.5"),
    # PR pytorch/pytorch#125795 (2024-05, "Clean up selective activation checkpoint and make public"), torch 2.4
    Api("torch.utils.checkpoint.create_selective_checkpoint_contexts", "2.4"),
    Api("torch.utils.checkpoint.CheckpointPolicy", "2.4"),
    # pytorch/tutorials#2718 (2023-12, the DeviceMesh recipe, labelled 2.2): torch.distributed.device_mesh public
    Api("torch.distributed.device_mesh", "2.2"),
    # PR pytorch/pytorch#121325 (merged 2024-03-08, "[DCP] Makes async_save public"), torch 2.3
    Api("torch.distributed.checkpoint.async_save", "2.3"),
    # pytorch/pytorch#119800 (maintainer: "In PyTorch v2.2, we have added ... torch.distributed.checkpoint.state_dict")
    Api("torch.distributed.checkpoint.state_dict", "2.2"),
    # PR pytorch/pytorch#113867 (2023-11, dcp.save / dcp.load with checkpoint_id), torch 2.2
    Api("torch.distributed.checkpoint.save", "2.2"),
    Api("torch.distributed.checkpoint.load", "2.2"),
    # PR pytorch/pytorch#168298 (2025-11-20, "Add public grouped_mm"; issue #166651), torch 2.10; ops.grouped_mm
    # falls back to a padded batched matmul without it
    Api("torch.nn.functional.grouped_mm", "2.10", optional=True),
)


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


# ------------------------------------------------------------------------------------------------- the scan
@dataclass(frozen=True)
class Use:
    name: str
    keywords: frozenset[str]
    positional: bool
    where: str


def aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the qualified name it stands for, from every import in the module (functions' included)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    names[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def qualified(node: ast.AST, names: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in names:
        return None
    return ".".join([names[node.id], *reversed(parts)])


def uses(source: str, where: str) -> list[Use]:
    """Every torch name the module reaches: calls (with their keywords), attribute reads, imported names."""
    tree = ast.parse(source)
    names = aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = qualified(node.func, names)
            if name:
                found.append(Use(name, frozenset(k.arg for k in node.keywords if k.arg), bool(node.args),
                                 f"{where}:{node.lineno}"))
        elif isinstance(node, (ast.Attribute, ast.Name)):
            name = qualified(node, names)
            if name and name.startswith("torch"):
                found.append(Use(name, frozenset(), False, f"{where}:{node.lineno}"))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            for alias in node.names:
                name = f"{module}.{alias.name}" if module else alias.name
                if name.startswith("torch"):
                    found.append(Use(name, frozenset(), False, f"{where}:{node.lineno}"))
                    if module:
                        found.append(Use(module, frozenset(), False, f"{where}:{node.lineno}"))
    return found


def matches(api: Api, use: Use) -> bool:
    if use.name != api.name and not use.name.startswith(api.name + "."):
        return False
    if api.keyword is not None and api.keyword not in use.keywords:
        return False
    return use.positional or not api.positional


def guarded(source: str, api: Api) -> bool:
    """The module checks `hasattr(<the API's module>, "<its name>")` before using it."""
    tree = ast.parse(source)
    names = aliases(tree)
    module, _, attr = api.name.rpartition(".")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr"
                and len(node.args) == 2 and qualified(node.args[0], names) == module
                and isinstance(node.args[1], ast.Constant) and node.args[1].value == attr):
            return True
    return False


def scan() -> dict[Api, list[Use]]:
    """Each table API the package uses -> where."""
    used: dict[Api, list[Use]] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        source = path.read_text()
        where = str(path.relative_to(ROOT))
        for use in uses(source, where):
            for api in API_SINCE:
                if matches(api, use):
                    if api.optional:
                        assert guarded(source, api), f"{use.where}: {api.name} (torch {api.since}) is marked " \
                                                     f"optional but the module does not check hasattr first"
                    used.setdefault(api, []).append(use)
    return used


def floor() -> str:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    specs = [re.fullmatch(r"torch\s*>=\s*([\d.]+)", dep.split(";")[0].strip()) for dep in dependencies]
    found = [spec.group(1) for spec in specs if spec]
    assert len(found) == 1, f"pyproject.toml: expected one 'torch>=X' dependency, got {dependencies}"
    return found[0]


# ------------------------------------------------------------------------------------------------- the tests
def test_the_scan_sees_through_aliases_imports_and_keywords():
    source = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

def f(q, k, v, ps):
    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    nn.utils.get_total_norm(ps)
    torch.is_autocast_enabled("cpu")
    torch.is_autocast_enabled()
    if hasattr(F, "grouped_mm"):
        F.grouped_mm(q, k)
"""
    found = uses(source, "m.py")
    by_name = {api: [u for u in found if matches(api, u)] for api in API_SINCE}
    get = lambda name, **kw: next(a for a in API_SINCE if a.name == name and all(getattr(a, k) == v  # noqa: E731
                                                                                  for k, v in kw.items()))
    assert by_name[get("torch.nn.functional.scaled_dot_product_attention")]
    assert by_name[get("torch.nn.utils.get_total_norm")]
    assert by_name[get("torch.distributed.checkpoint.state_dict")]
    assert len(by_name[get("torch.is_autocast_enabled")]) == 1, "only the call with a device type counts"
    assert guarded(source, get("torch.nn.functional.grouped_mm"))
    assert not by_name[get("torch.compiler.set_stance")]


def test_pyproject_floor_covers_every_api_the_package_uses():
    used = scan()
    # the scan works on the real tree: the trainer's gradient clipping is in it
    assert any(api.name == "torch.nn.utils.get_total_norm" for api in used), sorted(a.name for a in used)
    required = {api: places for api, places in used.items() if not api.optional}
    newest = max(required, key=lambda api: version(api.since))
    assert version(floor()) >= version(newest.since), (
        f"pyproject.toml says torch>={floor()}, but {newest.name} (torch {newest.since}) is used at "
        f"{', '.join(u.where for u in required[newest][:3])}")


def test_floor_is_not_above_what_the_code_needs():
    """A floor higher than the newest API used turns users away for nothing (raise it with a reason in API_SINCE)."""
    required = [api for api in scan() if not api.optional]
    assert version(floor()) == max(version(api.since) for api in required)


@pytest.mark.parametrize("path", ["README.md", "src/hybridtron/__init__.py"])
def test_stated_floors_agree_with_pyproject(path):
    """Wherever a torch minimum is written for users ("torch >= 2.6", "torch>=2.6"), it is pyproject's."""
    stated = set(re.findall(r"torch\s*>=\s*(\d+\.\d+(?:\.\d+)?)", (ROOT / path).read_text()))
    assert stated <= {floor()}, f"{path} states torch >= {sorted(stated)}, pyproject.toml torch>={floor()}"
