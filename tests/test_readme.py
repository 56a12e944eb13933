"""The README stays true and whole: its annotated layout names every module of the package, and no section is
written twice."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "hybridtron"


def layout_block() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"^## Layout\n+```\n(.*?)```", readme, re.S | re.M)
    assert match, "README.md has no '## Layout' section with a code block"
    return match.group(1)


def test_the_layout_names_every_module_and_package():
    block = layout_block()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) > 2:  # a module of a sub-package (post/envs/math.py): the sub-package's line covers it
            name = f"{parts[1]}/"
        elif path.name == "__init__.py":
            name = f"{parts[0]}/" if len(parts) == 2 else "config.py"
        else:
            name = path.name
        if name not in block:
            missing.append("/".join(parts))
    assert not missing, f"README.md's layout does not mention: {', '.join(missing)}"


def test_no_section_is_written_twice():
    """Each heading once: an edit once pasted the quickstart into the GRPO section, followed by a second copy of the
    README from "Commands" on, and nothing noticed for two days."""
    headings = re.findall(r"^#{2,4} .+$", (ROOT / "README.md").read_text(), re.M)
    repeated = sorted({h for h in headings if headings.count(h) > 1})
    assert not repeated, f"README.md repeats the section(s): {', '.join(repeated)}"
