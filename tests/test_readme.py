"""The README, the guides under docs/ (docs/experiments/ included) and BENCHMARKS.md stay true and whole: the README's
layout names every module of the package, its tour links every guide, no file repeats a section, every relative link
resolves (anchors included), BENCHMARKS.md opens with the table of current figures (one row a figure, each naming its
CPU) and stays short, docs/LOG.md opens with an index of its entries, and every command shown in a shell block names
a real command of `hybridtron` with options it accepts.

Fast by design: nothing here trains or runs a command; the commands are parsed by the CLI's own argparse parsers."""

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

from hybridtron import cli

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "hybridtron"
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
LOG = ROOT / "docs" / "LOG.md"
# one guide per stage of the recipe, each linked from the README's tour
GUIDES = ("model", "pretraining", "nvfp4", "stability", "inference", "post-training", "evaluation", "research",
          "scale-out")
MAX_README_LINES = 350
MAX_BENCHMARKS_LINES = 400
FIGURE_COLUMNS = ["figure", "value", "goal", "command", "CPU", "date"]


def markdown_files() -> list[Path]:
    docs = ROOT / "docs"
    return [README, BENCHMARKS, *sorted(docs.glob("*.md")), *sorted((docs / "experiments").glob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def split_fences(text: str) -> tuple[list[tuple[int, str]], list[tuple[str, int, list[str]]]]:
    """(prose lines outside fenced code blocks as (line number, text), fenced blocks as (info string, first line
    number, lines))."""
    prose, blocks, block = [], [], None
    for number, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            if block is None:
                block = (line[3:].strip(), number + 1, [])
            else:
                blocks.append(block)
                block = None
        elif block is not None:
            block[2].append(line)
        else:
            prose.append((number, line))
    assert block is None, f"a fenced code block opened at line {block[1] - 1} is never closed"
    return prose, blocks


def headings(path: Path) -> list[str]:
    prose, _ = split_fences(path.read_text())
    return [line for _, line in prose if re.match(r"#{1,6} ", line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    text = re.sub(r"^#{1,6} ", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(path):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link outside code (fenced blocks and inline code spans)."""
    prose, _ = split_fences(path.read_text())
    found = []
    for number, line in prose:
        line = re.sub(r"`[^`]*`", "", line)
        found += [(number, target) for target in re.findall(r"\]\(([^)\s]+)\)", line)]
    return found


# ---------------------------------------------------------------------------------------------------------- layout


def layout_block() -> str:
    readme = README.read_text()
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


# ------------------------------------------------------------------------------------------------- shape of the docs


@pytest.mark.parametrize("path", markdown_files(), ids=rel)
def test_no_section_is_written_twice(path):
    """Each heading once per file: an edit once pasted the quickstart into the GRPO section, followed by a second copy
    of the README from "Commands" on, and nothing noticed for two days."""
    found = [h for h in headings(path) if not h.startswith("# ")]
    repeated = sorted({h for h in found if found.count(h) > 1})
    assert not repeated, f"{rel(path)} repeats the section(s): {', '.join(repeated)}"


def test_the_readme_is_short():
    """The README says what hybridtron is, the two quickstart commands, the commands and a tour with links; the rest
    lives in the guides (issue 38)."""
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; at most {MAX_README_LINES} (move usage to docs/)"


def test_the_readme_keeps_the_two_quickstart_commands():
    _, blocks = split_fences(README.read_text())
    shell = "\n".join("\n".join(lines) for info, _, lines in blocks if info == "bash")
    for command in ("./scripts/pretrain.sh", "./scripts/test.sh"):
        assert re.search(rf"^{re.escape(command)}(\s|$)", shell, re.M), f"README.md's quickstart lacks {command}"


def test_the_readme_tour_links_every_guide():
    linked = {target.split("#")[0] for _, target in links(README)}
    for guide in GUIDES:
        assert (ROOT / "docs" / f"{guide}.md").is_file(), f"docs/{guide}.md, the guide of a stage, is missing"
        assert f"docs/{guide}.md" in linked, f"README.md does not link docs/{guide}.md"


def test_the_readme_command_table_lists_every_command_with_real_options():
    """One row per command of the registry, with options the command accepts."""
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `hybridtron ")]
    named = {}
    for row in rows:
        first = row.split(" | ")[0]
        command = first.split()[2].rstrip("`")
        named[command] = first
    missing = sorted(set(cli.COMMANDS) - set(named))
    assert not missing, f"README.md's command table lacks: {', '.join(missing)}"
    for command, cell in named.items():
        assert command in cli.COMMANDS, f"README.md's command table names `hybridtron {command}`, not a command"
        helptext = command_help(command)
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", cell):
            assert re.search(rf"(?<![\w-]){flag}(?![\w-])", helptext), \
                f"README.md's command table: `hybridtron {command}` has no option {flag}"


def test_every_relative_link_resolves():
    broken = []
    for path in markdown_files():
        for number, target in links(path):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            destination = (path.parent / file_part).resolve() if file_part else path
            if not destination.exists():
                broken.append(f"{rel(path)}:{number}: {target} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
                broken.append(f"{rel(path)}:{number}: {target} (no such heading in {rel(destination)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_docs_name_no_missing_doc_file():
    """A doc named in the prose (docs/SCALE.md, BENCHMARKS.md, ...), linked or not, exists (from the repository root
    or the naming file's folder): a guide folded into another leaves no reader at a missing file. docs/LOG.md is
    history and may name files as they were then."""
    missing = []
    for path in markdown_files():
        if path == LOG:
            continue
        prose, _ = split_fences(path.read_text())
        for number, line in prose:
            for name in re.findall(r"(?<![\w./-])((?:docs/[\w/-]+|[A-Z][A-Z_]+)\.md)\b", line):
                if not (ROOT / name).exists() and not (path.parent / name).exists():
                    missing.append(f"{rel(path)}:{number}: {name}")
    assert not missing, "these files are named but do not exist:\n" + "\n".join(missing)


def test_benchmarks_opens_with_the_table_of_current_figures():
    """The first thing in BENCHMARKS.md after its title and a paragraph: one table of the current figures."""
    text = BENCHMARKS.read_text()
    before_sections = text.split("\n## ", 1)[0]
    tables = re.findall(r"((?:^\|.*\|\n)+)", before_sections, re.M)
    assert len(tables) == 1, "BENCHMARKS.md must open with one table (the current figures) before its first section"
    rows = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in tables[0].strip().split("\n")]
    assert rows[0] == FIGURE_COLUMNS, f"the current-figures table's columns are {rows[0]}, not {FIGURE_COLUMNS}"
    assert re.fullmatch(r"[-:| ]+", tables[0].split("\n")[1]), "the table's second line must be its separator"
    figures = rows[2:]
    assert len(figures) >= 10, "the current-figures table has too few rows"
    # the CPUs a row may name: the bold names of the list under the table ("- **Zen 4**: AMD EPYC ...")
    cpus = re.findall(r"^- \*\*([^*]+)\*\*:", before_sections, re.M)
    assert cpus, "BENCHMARKS.md has no list of CPUs (\"- **NAME**: lscpu's model and flags\") under its table"
    for row in figures:
        assert len(row) == len(FIGURE_COLUMNS), f"a row of the current-figures table has {len(row)} cells: {row}"
        figure, value, goal, command, cpu, date = row
        assert figure and value and goal and command and cpu, f"an empty cell in the current-figures table: {row}"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), f"not a date in the current-figures table: {row}"
        assert any(cpu == name or cpu.startswith(f"{name} (") for name in cpus), \
            f"the current-figures row {figure!r} names the CPU {cpu!r}, not one of the list under the table " \
            f"({', '.join(cpus)}); a run whose CPU was not recorded belongs in docs/LOG.md"
        assert "the same" not in command, f"the current-figures row {figure!r} must write its command out"
    names = [row[0] for row in figures]
    assert len(set(names)) == len(names), "a figure has two rows in the current-figures table (keep the newest)"


def test_benchmarks_is_short():
    """One row per figure and a few lines per run; longer write-ups live in docs/experiments/, older runs in
    docs/LOG.md (issue 46: the file had grown to 1,777 lines)."""
    lines = len(BENCHMARKS.read_text().splitlines())
    assert lines <= MAX_BENCHMARKS_LINES, \
        f"BENCHMARKS.md has {lines} lines; at most {MAX_BENCHMARKS_LINES} (move write-ups to docs/experiments/, " \
        "older runs to docs/LOG.md)"


def test_the_log_opens_with_an_index_of_its_entries():
    text = LOG.read_text()
    assert "\n## Index\n" in text, "docs/LOG.md has no '## Index' section"
    index_part = text.split("\n## Index\n", 1)[1].split("\n## ", 1)[0]
    linked = set(re.findall(r"\]\(#([^)]+)\)", index_part))
    entries = [h for h in headings(LOG) if re.match(r"#{2,3} ", h) and h != "## Index"]
    unlisted = [h for h in entries if slug(h) not in linked]
    assert not unlisted, "docs/LOG.md's index does not link these entries (add a line to its index):\n" + \
        "\n".join(unlisted)


# ------------------------------------------------------------------------------------------------ the examples' code


def command_help(command: str) -> str:
    """`hybridtron COMMAND --help`, and each subcommand's (`eval loss --help`) after it."""
    parser = cli.build_parser(load=command)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    command_parser = parser._subparsers._group_actions[0].choices[command]
    for action in command_parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name in action.choices:
                with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
                    parser.parse_args([command, name, "--help"])
    return out.getvalue()


def shell_commands(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, words) of every simple command in the file's ```bash blocks, and of every `$ `-prompted line in
    its other blocks (transcripts). Continuation lines are joined, comments dropped, and a pipeline or list split at
    its operators; a redirection and its target are dropped."""
    _, blocks = split_fences(path.read_text())
    found = []
    for info, first, lines in blocks:
        if info not in ("bash", "sh", "shell", "console", "text", ""):
            continue
        i = 0
        while i < len(lines):
            number, line = first + i, lines[i]
            prompted = line.startswith("$ ")
            if info == "bash" or prompted:
                line = line[2:] if prompted else line
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i]
                lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
                lexer.whitespace_split = True
                lexer.commenters = "#"
                words: list[str] = []
                redirect = False
                for word in lexer:
                    if redirect:
                        redirect = False
                    elif set(word) <= set(";&|()"):
                        if words:
                            found.append((number, words))
                        words = []
                    elif set(word) <= set("<>"):
                        redirect = True
                    else:
                        words.append(word)
                if words:
                    found.append((number, words))
            i += 1
    return found


def hybridtron_args(words: list[str]) -> list[str] | None:
    """The arguments after `hybridtron` (or `torchrun ... -m hybridtron`, or `python -m hybridtron`), or None."""
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return None
    if Path(words[0]).name == "hybridtron":
        return words[1:]
    if words[0] in ("torchrun", "python", "python3") and "-m" in words:
        at = words.index("-m")
        if at + 1 < len(words) and words[at + 1] == "hybridtron":
            return words[at + 2:]
    return None


def example_files() -> list[Path]:
    return markdown_files()


@pytest.mark.parametrize("path", example_files(), ids=rel)
def test_shell_examples_name_real_commands_and_options(path):
    """Every `hybridtron X ...` in a shell block parses with `hybridtron X`'s own parser (the command exists, each
    option exists and takes a valid value, required options are there), as the CLI would parse it; a command
    written with `...` standing for arguments to fill in is skipped (only templates in text blocks have them).
    `python -m MODULE` names an importable module, `python FILE` and `./FILE` an existing file, and
    `python -c CODE` compiles."""
    problems = []
    for number, words in shell_commands(path):
        where = f"{rel(path)}:{number}: {' '.join(words)}"
        args = hybridtron_args(words)
        if args is not None:
            if "..." in args or not args:
                continue
            command = args[0]
            if command not in cli.COMMANDS:
                problems.append(f"{where}\n    `hybridtron {command}` is not a command ({', '.join(cli.COMMANDS)})")
                continue
            parser = cli.build_parser(load=command)
            errors = io.StringIO()
            with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                try:
                    parser.parse_args(args)
                except SystemExit as exc:
                    if exc.code:
                        problems.append(f"{where}\n    {errors.getvalue().strip().splitlines()[-1]}")
            continue
        program = words[0]
        if program in ("python", "python3") and len(words) > 1:
            if words[1] == "-m" and len(words) > 2:
                if importlib.util.find_spec(words[2]) is None:
                    problems.append(f"{where}\n    no module {words[2]}")
            elif words[1] == "-c" and len(words) > 2:
                try:
                    compile(words[2], where, "exec")
                except SyntaxError as exc:
                    problems.append(f"{where}\n    {exc}")
            elif words[1].endswith(".py") and not (ROOT / words[1]).is_file():
                problems.append(f"{where}\n    no file {words[1]}")
        elif program.startswith("./") and not (ROOT / program).is_file():
            problems.append(f"{where}\n    no file {program}")
    assert not problems, "shell examples that would not run as written:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", example_files(), ids=rel)
def test_python_examples_compile(path):
    _, blocks = split_fences(path.read_text())
    for info, first, lines in blocks:
        if info == "python":
            compile("\n".join(lines), f"{rel(path)}:{first}", "exec")


def test_the_shell_block_parser_sees_the_commands():
    """The check above is only as good as its parser: the quickstart's commands and a torchrun line are seen."""
    words = [w for _, w in shell_commands(ROOT / "docs" / "scale-out.md")]
    assert any(hybridtron_args(w) and hybridtron_args(w)[0] == "plan" for w in words)
    assert any(w[0] == "torchrun" and hybridtron_args(w) for w in words)
    assert isinstance(cli.build_parser(), argparse.ArgumentParser)
