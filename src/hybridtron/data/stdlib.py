"""The embedded default corpus: the running Python's standard library source, bucketed as topic x quality.

Every machine that runs hybridtron has it, so a pretraining run needs no download. The `.py` files under
`sysconfig.get_paths()["stdlib"]` (site-packages and dist-packages excluded; files that are not UTF-8 skipped)
become code documents. Files longer than `max_document_chars` are split at line boundaries into parts
(`path#1`, `path#2`, ...) that keep the file's bucket and fall on the same side of the validation split.

Buckets follow the Nemotron 3 data design (about 200 buckets = 40 topics x 5 quality levels), named
`"{family}/q{level}"`:

- Topic: the module family (`FAMILIES`, 40 of them). A library file takes the family of its top-level
  package or module. A test file `test/test_X...` takes the family of the module it tests (`X`, then `X`
  without its trailing `_part`s or digits, so `test_xml_etree_c` -> xml, `test_urllib2net` -> web); tests of
  the interpreter itself (grammar, builtins, C API) that match no module stay in the `test` family. Names
  that match no family go to the catch-all `other`.
- Quality (`quality_level`, 1 = lowest, 5 = highest), a fixed rule on the file's own text, so a file's
  level never depends on which other files are loaded:

      score = 2 * min(doc_density, 0.4) / 0.4    documentation: share of lines in comments or triple-quoted strings
            - 1 if the file is a test               `is_test_path`; tests teach an API less directly than its code
            - 2 * min(long_line_share, 0.25) / 0.25   share of lines over 100 characters (tables, data dumps)
            - 1 if it has fewer than 10 code lines  stubs, `__init__` re-exports
            - 1 if over half its code lines are literals only   codec tables, generated data
      level = 1 + number of thresholds in QUALITY_THRESHOLDS that the score reaches

  The thresholds were set once so that the five levels hold roughly equal shares of CPython 3.11's stdlib.

A second view (`stdlib_repo_documents`) stitches each top-level package's files (and, for the top-level
modules, each family's modules) into long documents with `<|file|>path` headers: repository-level data for
long-context training, bucketed `"repos/{family}"`.
"""

from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from hybridtron.data.corpus import Document, split_text
from hybridtron.data.tokenizer import FILE_TOKEN

# Module family -> the top-level modules, packages, C modules and test-name stems that belong to it.
FAMILIES: dict[str, tuple[str, ...]] = {
    "asyncio": ("asyncio", "asynchat", "asyncore", "selectors", "asyncgen", "coroutines", "contextlib_async"),
    "concurrency": ("concurrent", "threading", "_threading_local", "queue", "sched", "contextvars", "context",
                    "thread", "threadsignals", "threadedtempfile", "lock_tests", "interpreters", "_xxsubinterpreters"),
    "multiprocessing": ("multiprocessing", "_test_multiprocessing", "_test_venv_multiprocessing",
                        "mp_fork_bomb", "mp_preload"),
    "email": ("email", "smtplib", "smtpd", "smtpnet", "poplib", "imaplib", "mailbox", "mailcap", "nntplib",
              "mimetypes", "flufl"),
    "encodings": ("encodings", "codecs", "stringprep", "codeccallbacks", "codecencodings", "codecmaps", "charmapcodec",
                  "multibytecodec", "multibytecodec_support", "unicode", "ucn", "utf8", "utf8source", "source_encoding",
                  "testcodec", "unicodedata", "cjkencodings", "encoded_modules"),
    "json": ("json",),
    "xml": ("xml", "xmlrpc", "pyexpat", "sax", "minidom", "pulldom", "xmltests", "docxmlrpc"),
    "web": ("html", "http", "urllib", "urllib2", "urlparse", "wsgiref", "webbrowser", "cgi", "cgitb", "_markupbase",
            "htmlparser", "httplib", "httpservers", "robotparser", "urllibnet", "urllib2net"),
    "network": ("socket", "socketserver", "ssl", "ssl_servers", "ssltests", "ftplib", "telnetlib", "ipaddress",
                "select", "poll", "epoll", "kqueue", "devpoll", "timeout", "mock_socket"),
    "tkinter": ("tkinter", "turtle", "turtledemo", "tcl", "tk", "ttk", "tix"),
    "idle": ("idlelib", "idle"),
    "testing": ("unittest", "doctest", "doctest2", "support", "libregrtest", "regrtest", "script_helper",
                "sample_doctest", "doctest_aliases", "doctest_lineno", "autotest", "pythoninfo", "memory_watchdog",
                "leakers"),
    "packaging": ("distutils", "ensurepip", "venv", "site", "sysconfig", "_sysconfigdata", "zipapp", "_aix_support",
                  "_osx_support", "_bootsubprocess", "compileall", "py_compile", "cppext", "getpath", "launcher",
                  "python-config", "osx_env"),
    "lib2to3": ("lib2to3",),
    "ctypes": ("ctypes", "stable_abi_ctypes"),
    "import": ("importlib", "imp", "zipimport", "runpy", "pkgutil", "modulefinder", "import", "pkg", "relimport",
               "__future__", "future_stmt", "frozen", "imp_dummy", "__hello__", "__phello__", "module"),
    "logging": ("logging",),
    "re": ("re", "sre_compile", "sre_constants", "sre_parse", "re_tests", "reperf"),
    "collections": ("collections", "_collections_abc", "heapq", "bisect", "weakref", "_weakrefset", "weakset",
                    "graphlib", "copy", "copyreg", "array", "deque", "defaultdict", "ordered_dict", "userdict",
                    "userlist", "userstring", "mapping_tests", "list_tests", "seq_tests"),
    "typing": ("typing", "types", "abc", "_py_abc", "dataclasses", "enum", "genericalias", "genericclass",
               "type_annotations", "typinganndata", "typechecks", "isinstance", "abstract_numbers",
               "dynamicclassattribute"),
    "functional": ("functools", "operator", "itertools", "contextlib", "decorators", "generators", "genexps",
                   "yield_from", "with", "extcall", "keywordonlyarg", "positional_only_arg"),
    "numeric": ("math", "cmath", "decimal", "_pydecimal", "fractions", "numbers", "random", "statistics", "colorsys",
                "float", "complex", "long", "int", "numeric_tower", "strtod", "pow", "ieee754", "decimaltestdata",
                "math_testcases", "cmath_testcases", "formatfloat_testcases", "floating_points"),
    "time": ("datetime", "_strptime", "calendar", "time", "zoneinfo", "strftime", "strptime", "datetimetester"),
    "files": ("os", "posixpath", "ntpath", "genericpath", "pathlib", "shutil", "stat", "glob", "fnmatch", "tempfile",
              "filecmp", "fileinput", "linecache", "nturl2path", "file", "fileio", "fileutils", "largefile",
              "unicode_file", "unicode_file_functions", "univnewlines", "mmap"),
    "compression": ("zipfile", "zipfile64", "tarfile", "gzip", "bz2", "lzma", "zlib", "_compression",
                    "ziptestdata", "testtar"),
    "storage": ("pickle", "_compat_pickle", "pickletools", "pickletester", "picklebuffer", "shelve", "dbm", "sqlite3",
                "marshal", "plistlib", "csv"),
    "cli": ("argparse", "optparse", "getopt", "cmd", "shlex", "getpass", "cmd_line", "cmd_line_script"),
    "config": ("configparser", "tomllib", "netrc", "configdata"),
    "text": ("string", "textwrap", "difflib", "pprint", "reprlib", "gettext", "locale", "_locale", "string_tests",
             "fstring", "format", "string_literals"),
    "io": ("io", "_pyio", "memoryio", "bufio", "_compression_io", "fileinput_io", "eintr", "_test_eintr", "file_eintr"),
    "terminal": ("curses", "curses_tests", "tty", "pty", "readline", "rlcompleter", "termios", "openpty", "repl"),
    "media": ("wave", "aifc", "sunau", "sndhdr", "imghdr", "chunk", "audioop", "ossaudiodev", "audiotests", "audiotest",
              "audiodata", "sndhdrdata", "imghdrdata", "winsound"),
    "debug": ("pdb", "bdb", "profile", "cProfile", "cprofile", "pstats", "trace", "traceback", "tracemalloc",
              "faulthandler", "timeit", "profilee", "tracedmodules", "bisect_cmd", "sys_setprofile", "sys_settrace",
              "lltrace", "gdb", "dtrace", "dtracedata", "audit", "audit-tests", "inspect", "warnings"),
    "compiler": ("ast", "tokenize", "token", "keyword", "symtable", "opcode", "dis", "pyclbr", "tabnanny", "code",
                 "codeop", "peg_generator", "unparse", "grammar", "compile", "peepholer", "opcache", "clinic",
                 "asdl_parser", "tokenizedata", "dis_module", "pyclbr_input", "type_comments", "syntax", "tools"),
    "system": ("subprocess", "signal", "platform", "sys", "atexit", "_test_atexit", "gc", "resource", "pwd", "grp",
               "spwd", "errno", "fcntl", "posix", "wait3", "wait4", "fork1", "fork_wait", "popen", "syslog", "crypt",
               "ioctl", "winreg", "winconsoleio", "startfile", "subprocessdata", "signalinterproctester", "embed",
               "_test_embed_set_config", "_test_embed_structseq", "utf8_mode", "c_locale_coercion", "nis"),
    "crypto": ("hashlib", "hmac", "secrets", "uuid", "time_hashlib", "certdata"),
    "binary": ("base64", "binascii", "uu", "quopri", "struct", "xdrlib", "pipes", "buffer", "memoryview", "bytes"),
    "docs": ("pydoc", "pydoc_data", "pydoc_mod", "pydocfodder"),
    "test": ("test",),
    "other": ("antigravity", "this", "_sitebuiltins", "sundry", "xxlimited", "xxtestfuzz"),
}

NAME_TO_FAMILY = {name: family for family, names in FAMILIES.items() for name in names}
QUALITY_LEVELS = 5
# Score cut points between quality levels 1|2, 2|3, 3|4, 4|5 (see the module docstring for the score).
QUALITY_THRESHOLDS = (-0.65, -0.35, 0.5, 1.35)

_TRIPLE_QUOTED = re.compile(r'("""|\'\'\')[\s\S]*?\1')
_STRING_LITERAL = re.compile(r"""[rbuRBU]*('[^']*'|"[^"]*")""")
_LITERALS_ONLY = re.compile(r"^[\s\d\[\]{}(),.:+\-_xXoOjJa-fA-F]*$")  # numbers (hex too) and brackets


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def family_of(relative_path: str) -> str:
    """Family of a stdlib file given its path relative to the stdlib root (`"asyncio/tasks.py"`)."""
    parts = relative_path.split("/")
    if parts[0] != "test" or len(parts) == 1:
        return family_of_name(parts[0].removesuffix(".py"))
    stem = parts[1].removesuffix(".py")
    if stem in ("__init__", "__main__"):
        return "test"
    return _family_of_test_stem(stem)


def family_of_name(top: str) -> str:
    """Family of a top-level module or package name; generated names such as
    `_sysconfigdata__linux_x86_64-linux-gnu` or `config-3.11-x86_64-linux-gnu` by their first word."""
    return NAME_TO_FAMILY.get(top, NAME_TO_FAMILY.get(re.split(r"__|-", top)[0] or top, "other"))


def _family_of_test_stem(stem: str) -> str:
    name = stem.removeprefix("test_")
    while name:
        for candidate in (name, name.rstrip("0123456789")):
            if candidate in NAME_TO_FAMILY:
                return NAME_TO_FAMILY[candidate]
        if "_" not in name.strip("_"):
            break
        name = name.rsplit("_", 1)[0]
    return "test"


@dataclass(frozen=True)
class QualitySignals:
    """What the quality rule reads from a file; kept so the rule can be inspected and tested."""

    doc_density: float  # share of non-blank lines inside comments or triple-quoted strings
    long_line_share: float  # share of non-blank lines longer than 100 characters
    code_lines: int  # non-blank lines outside comments and triple-quoted strings
    literal_share: float  # share of code lines made only of literals, brackets and commas (comments aside)
    is_test: bool

    @property
    def score(self) -> float:
        score = 2.0 * min(self.doc_density, 0.4) / 0.4
        score -= 1.0 if self.is_test else 0.0
        score -= 2.0 * min(self.long_line_share, 0.25) / 0.25
        score -= 1.0 if self.code_lines < 10 else 0.0
        score -= 1.0 if self.literal_share > 0.5 else 0.0
        return score

    @property
    def level(self) -> int:
        return 1 + sum(self.score >= threshold for threshold in QUALITY_THRESHOLDS)


def quality_signals(text: str, is_test: bool) -> QualitySignals:
    doc_lines = sum(match.group(0).count("\n") + 1 for match in _TRIPLE_QUOTED.finditer(text))
    code_text = _TRIPLE_QUOTED.sub("", text)
    nonblank = [line for line in text.splitlines() if line.strip()]
    code = [line for line in code_text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    comment_lines = sum(1 for line in code_text.splitlines() if line.lstrip().startswith("#"))
    n_nonblank = max(len(nonblank), 1)
    return QualitySignals(
        doc_density=min((doc_lines + comment_lines) / n_nonblank, 1.0),
        long_line_share=sum(len(line) > 100 for line in nonblank) / n_nonblank,
        code_lines=len(code),
        literal_share=sum(map(_is_literal_line, code)) / max(len(code), 1),
        is_test=is_test,
    )


def _is_literal_line(line: str) -> bool:
    return bool(_LITERALS_ONLY.match(_STRING_LITERAL.sub("", line.split("#")[0])))


def quality_level(text: str, is_test: bool) -> int:
    """Quality level 1..5 of a source file (the rule is in the module docstring)."""
    return quality_signals(text, is_test).level


@dataclass(frozen=True)
class StdlibFile:
    path: str  # relative to the stdlib root, "/"-separated
    text: str
    family: str
    quality: int

    @property
    def bucket(self) -> str:
        return f"{self.family}/q{self.quality}"


def is_test_path(relative_path: str) -> bool:
    """A test file: inside a `test`, `tests` or `idle_test` directory, or named `test_*.py`."""
    *directories, name = relative_path.split("/")
    return name.startswith("test_") or any(d in ("test", "tests", "idle_test") for d in directories)


def stdlib_files(families: tuple[str, ...] | None = None, root: Path | None = None) -> list[StdlibFile]:
    """Every UTF-8 `.py` file of the stdlib in sorted path order, with its family and quality level."""
    if families is not None:
        unknown = sorted(set(families) - set(FAMILIES))
        if unknown:
            raise ValueError(f"families: unknown stdlib families {unknown}; expected some of {sorted(FAMILIES)}")
    root = stdlib_root() if root is None else root
    paths = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        paths += [Path(directory, name) for name in names if name.endswith(".py")]
    files = []
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        relative = path.relative_to(root).as_posix()
        family = family_of(relative)
        if families is not None and family not in families:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):  # a few test fixtures are latin-1 or koi8-r on purpose
            continue
        files.append(StdlibFile(relative, text, family, quality_level(text, is_test_path(relative))))
    return files


def stdlib_documents(files: list[StdlibFile], max_document_chars: int) -> list[Document]:
    """One document per file (or per part of a long file), bucket `"{family}/q{level}"`."""
    documents = []
    for file in files:
        parts = split_text(file.text, max_document_chars)
        for index, part in enumerate(parts):
            suffix = f"#{index + 1}" if len(parts) > 1 else ""
            documents.append(Document(f"stdlib:{file.path}{suffix}", part, file.bucket, f"stdlib:{file.path}"))
    return documents


def stdlib_repo_documents(files: list[StdlibFile], max_document_chars: int, max_repo_chars: int) -> list[Document]:
    """Repository-level documents: each top-level package's files, in path order, stitched with `<|file|>path`
    headers; the top-level modules are stitched per family. A repository longer than `max_repo_chars` is cut
    into several documents at file boundaries (files longer than `max_document_chars` are split first)."""
    repos: dict[tuple[str, str], list[StdlibFile]] = {}
    for file in files:
        top = file.path.split("/")[0]
        if top.endswith(".py"):
            key = (family_of(top), f"modules-{family_of(top)}")
        else:
            key = (family_of_name(top), top)
        repos.setdefault(key, []).append(file)
    documents = []
    for (family, repo), repo_files in sorted(repos.items(), key=lambda item: item[0][1]):
        pieces = [
            f"{FILE_TOKEN}{file.path}\n{part}" + ("" if part.endswith("\n") else "\n")
            for file in repo_files
            for part in split_text(file.text, max_document_chars)
        ]
        chunks: list[list[str]] = [[]]
        chunk_chars = 0
        for piece in pieces:
            if chunks[-1] and chunk_chars + len(piece) > max_repo_chars:
                chunks.append([])
                chunk_chars = 0
            chunks[-1].append(piece)
            chunk_chars += len(piece)
        for index, chunk in enumerate(chunks):
            suffix = f"#{index + 1}" if len(chunks) > 1 else ""
            doc_id = f"stdlib-repo:{repo}{suffix}"
            documents.append(Document(doc_id, "".join(chunk), f"repos/{family}", f"stdlib-repo:{repo}"))
    return documents
