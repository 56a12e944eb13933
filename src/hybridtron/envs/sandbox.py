"""Run untrusted Python (a policy's completion) against hidden unit tests, and score it by what it computes.

The recipe, in the order the protections are applied (`sandbox_runner.py` is the code that runs inside):

1. a separate process, `python -I -S` (no site, no user paths, no environment variables: `env={}`), started
   in a fresh temporary directory as the leader of a new session;
2. where the kernel allows it, new user, mount, PID, network, IPC and UTS namespaces: the candidate sees a
   private root (read-only Python and system libraries, a size-capped tmpfs as its working directory, a few
   device nodes, its own /proc), only a loopback interface that is down, and no process outside its PID
   namespace; a root parent maps it to `nobody`;
3. every capability dropped, no new privileges, Landlock (reads of Python and the system libraries only,
   writes only below the working directory, no TCP, no signals outside);
4. resource limits: CPU seconds, address space, processes, file size, open files, no core dumps;
5. a wall clock held by a trusted supervisor process, which kills the candidate and every descendant at the
   deadline (the PID namespace ends them all at once), and a second deadline here that kills the whole
   process group should the supervisor itself stall;
6. captured output and the result channel capped (a candidate printing gigabytes is cut off).

The verdict cannot be forged because it is not computed inside: each hidden test `assert EXPR == LITERAL` is
split here, only EXPR enters the sandbox, and the value it returns comes back as plain data (exact built-in
types, decoded here) to be compared with LITERAL, which never leaves this process. `sys.exit(0)` or
`os._exit(0)` before the tests, overridden builtins, a patched harness or a printed "all tests passed" line
can at best report wrong values: 0.

Which of the protections held is measured on every run (`SandboxResult.isolation`) and by `probe()`; where
the kernel refuses namespaces (unprivileged user namespaces disabled, seccomp in a container) the run goes on
with what did hold, and `Isolation.missing()` names what did not.
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

RUNNER = Path(__file__).with_name("sandbox_runner.py")
NOBODY = 65534  # sandbox_runner.NOBODY: who a root parent's candidate runs as
# A trajectory's own user id (under a root parent), drawn from a range no system account uses: RLIMIT_NPROC counts
# the processes of a user, so with one user for every sandbox, 16 trajectories' shells would share one process limit.
RUN_AS_RANGE = (200_000, 1_000_000)


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Limits of one sandboxed run. Times in seconds, sizes in MiB unless named bytes."""

    wall_s: float = 3.0          # wall clock for the candidate, from the end of the (trusted) setup
    cpu_s: int = 3               # RLIMIT_CPU per process (SIGXCPU, then SIGKILL one second later)
    memory_mb: int = 512         # RLIMIT_AS per process
    processes: int = 16          # RLIMIT_NPROC, counted inside the sandbox's user namespace
    file_mb: int = 16            # RLIMIT_FSIZE: the largest file it may write
    disk_mb: int = 32            # size of the tmpfs working directory (where the mount namespace holds)
    open_files: int = 64         # RLIMIT_NOFILE
    output_bytes: int = 16384    # captured stdout + stderr kept; past it the pipe is closed
    result_bytes: int = 1 << 20  # the result channel; past it the pipe is closed
    value_bytes: int = 1 << 16   # the largest encoded value of one expression
    setup_s: float = 5.0         # bound on the supervisor's own setup (mounts, limits)
    namespaces: bool = True      # try the namespaces (False: only Landlock and limits; for tests)
    landlock: bool = True

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("float", "int") and not value > 0:
                raise ValueError(f"SandboxConfig.{f.name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class Isolation:
    """What held in one run, as the trusted supervisor measured it."""

    user_ns: bool = False
    pid_ns: bool = False
    net_ns: bool = False
    ipc_ns: bool = False
    mount_ns: bool = False       # a private root: nothing of the host's file system but Python and libraries
    proc: bool = False           # a /proc of its own PID namespace
    caps_dropped: bool | None = False
    no_new_privs: bool = False
    landlock: bool = False
    landlock_abi: int = 0
    outer_uid: int = -1          # the candidate's user id outside its namespace
    errors: tuple[str, ...] = ()  # the steps the kernel refused, with errno

    @classmethod
    def from_report(cls, report: dict) -> "Isolation":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in report.items() if k in known}
        values["errors"] = tuple(values.get("errors", ()))
        return cls(**values)

    def missing(self) -> list[str]:
        """The protections that did not hold, each with what it costs."""
        out = []
        if not self.net_ns:
            out.append("network namespace (network: only Landlock's TCP rule holds"
                       + ("" if self.landlock_abi >= 4 else "; nothing here, Landlock ABI < 4") + ")")
        if not self.pid_ns:
            out.append("PID namespace (signals outside: only Landlock's scope holds"
                       + ("" if self.landlock_abi >= 6 else "; nothing here, Landlock ABI < 6") + ")")
        if not self.mount_ns:
            out.append("private root (files: only Landlock" + ("" if self.landlock else "; nothing here")
                       + "; disk use bounded per file only)")
        if not self.landlock:
            out.append("Landlock")
        if not self.caps_dropped:
            out.append("capabilities dropped")
        if self.outer_uid == 0:
            out.append("non-root user (RLIMIT_NPROC does not bind root)")
        return out

    def summary(self) -> str:
        held = [name for name, ok in (("user", self.user_ns), ("pid", self.pid_ns), ("net", self.net_ns),
                                      ("ipc", self.ipc_ns), ("mount", self.mount_ns)) if ok]
        parts = [("namespaces: " + "+".join(held)) if held else "no namespaces"]
        parts.append(f"landlock ABI {self.landlock_abi}" if self.landlock else "no landlock")
        parts.append(f"uid {self.outer_uid} outside")
        parts.append("no capabilities" if self.caps_dropped else "capabilities kept")
        return ", ".join(parts)


@dataclass(frozen=True)
class Outcome:
    """One expression's result: its value (plain data) or the exception it raised."""

    value: Any = None
    error: str | None = None


@dataclass(frozen=True)
class SandboxResult:
    outcomes: tuple[Outcome | None, ...]  # per expression; None where it was never reached
    load_error: str | None                # the source itself raised (SystemExit included)
    output: str                           # captured stdout + stderr, capped
    timed_out: bool
    disk_exceeded: bool                   # killed for writing more than disk_mb (watched without a tmpfs)
    exit_code: int | None                 # the candidate process's, as its supervisor saw it
    isolation: Isolation | None
    wall_s: float                         # the whole call, as seen by the caller
    supervisor_error: str | None = None   # the trusted side failed (a bug or a machine problem)
    output_truncated: bool = False        # output_bytes reached: the rest was cut off (the pipe closed)


@dataclass(frozen=True)
class UnitTest:
    """`assert EXPR == EXPECTED`: EXPR runs in the sandbox, EXPECTED (a literal) stays here."""

    expr: str
    expected: Any
    text: str


@dataclass(frozen=True)
class TestReport:
    passed: tuple[bool, ...]
    result: SandboxResult

    @property
    def share(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


def parse_test(text: str) -> UnitTest:
    """Split `assert EXPR == LITERAL` (the only form accepted: anything else would need the verdict to be
    computed inside the sandbox)."""
    try:
        tree = ast.parse(text.strip())
    except SyntaxError as e:
        raise ValueError(f"unit test {text!r} is not valid Python: {e.msg}") from None
    form = "expected a single `assert EXPR == LITERAL`"
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise ValueError(f"unit test {text!r}: {form}")
    test = tree.body[0].test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        raise ValueError(f"unit test {text!r}: {form}")
    try:
        expected = ast.literal_eval(test.comparators[0])
    except ValueError:
        raise ValueError(f"unit test {text!r}: the right-hand side must be a literal "
                         f"(numbers, strings, lists, tuples, dicts, sets, None, True, False)") from None
    return UnitTest(expr=ast.unparse(test.left), expected=expected, text=text)


def decode(obj: Any) -> Any:
    """Inverse of the runner's `encode`; raises ValueError on anything it would not have written."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if type(obj) is int:
        return obj
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if isinstance(obj, dict) and len(obj) == 1:
        (tag, payload), = obj.items()
        if tag == "i" and isinstance(payload, str):
            return int(payload)
        if tag == "f" and isinstance(payload, str):
            return float(payload)
        if tag == "t" and isinstance(payload, list):
            return tuple(decode(v) for v in payload)
        if tag == "d" and isinstance(payload, list):
            return {decode(k): decode(v) for k, v in payload}
        if tag == "s" and isinstance(payload, list):
            return {decode(v) for v in payload}
        if tag == "fs" and isinstance(payload, list):
            return frozenset(decode(v) for v in payload)
        if tag == "b" and isinstance(payload, str):
            return bytes.fromhex(payload)
    raise ValueError(f"malformed value {str(obj)[:80]}")


def _parse_outcomes(lines: list[bytes], n: int) -> tuple[list[Outcome | None], str | None]:
    """The first record per index wins (the candidate may append forged ones: they are only values)."""
    outcomes: list[Outcome | None] = [None] * n
    load_error = None
    for line in lines:
        try:
            record = json.loads(line)
            if "load_error" in record and load_error is None and all(o is None for o in outcomes):
                load_error = str(record["load_error"])
                continue
            i = record["i"]
            if type(i) is not int or not 0 <= i < n or outcomes[i] is not None:
                continue
            if "error" in record:
                outcomes[i] = Outcome(error=str(record["error"]))
            else:
                outcomes[i] = Outcome(value=decode(record["value"]))
        except (ValueError, KeyError, TypeError, RecursionError, OverflowError):
            continue
    return outcomes, load_error


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable_and_retry)


class _Stream:
    """One pipe read without blocking, kept up to `cap` bytes; past the cap it is closed."""

    def __init__(self, fd: int, cap: int):
        self.fd, self.cap, self.data, self.open, self.overflow = fd, cap, bytearray(), True, False
        os.set_blocking(fd, False)

    def read(self, selector: selectors.BaseSelector) -> None:
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        if chunk:
            self.data += chunk[: self.cap - len(self.data)]
            if len(self.data) < self.cap:
                return
            self.overflow = True
        self.close(selector)

    def close(self, selector: selectors.BaseSelector | None = None) -> None:
        if self.open:
            if selector is not None:
                selector.unregister(self.fd)
            os.close(self.fd)
            self.open = False


def run_python(source: str, exprs: Sequence[str], config: SandboxConfig = SandboxConfig(), *,
               workdir: str | os.PathLike | None = None, run_as: int | None = None) -> SandboxResult:
    """Execute `source`, then evaluate each expression in its namespace, inside the sandbox. `workdir`: a directory
    of the caller's (made by `make_workdir`) that the candidate works in and may write, kept after the run (a
    multi-turn environment's task directory); its size is watched against `disk_mb`. Without it the candidate
    gets a fresh one that is removed. `run_as`: the user id a root parent's candidate runs as (default nobody; see
    `new_run_as`)."""
    started = time.monotonic()
    if workdir is not None and not os.path.isdir(workdir):
        raise FileNotFoundError(f"sandbox workdir {workdir}: not a directory")
    own_dir = tempfile.mkdtemp(prefix="hybridtron-sandbox-")
    os.chmod(own_dir, 0o755)
    result_r, result_w = os.pipe()
    report_r, report_w = os.pipe()
    job = {"source": source, "exprs": list(exprs), "result_fd": result_w, "report_fd": report_w,
           "wall_s": config.wall_s, "setup_s": config.setup_s, "namespaces": config.namespaces,
           "landlock": config.landlock, "max_value_bytes": config.value_bytes,
           "workdir": None if workdir is None else os.path.realpath(workdir), "run_as": run_as,
           "limits": {k: getattr(config, k) for k in ("cpu_s", "memory_mb", "processes", "file_mb", "disk_mb",
                                                       "open_files")}}
    proc = None
    candidate_pidfd = None
    streams: list[_Stream] = []
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", str(RUNNER)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=own_dir, env={},
                                pass_fds=(result_w, report_w), start_new_session=True)
        os.close(result_w)
        os.close(report_w)
        result_w = report_w = -1
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        output = _Stream(os.dup(proc.stdout.fileno()), config.output_bytes)
        proc.stdout.close()
        results, report = _Stream(result_r, config.result_bytes), _Stream(report_r, 1 << 20)
        streams = [output, results, report]
        # Our own deadline, past the supervisor's: only reached if the supervisor itself stalls.
        deadline = started + config.setup_s + config.wall_s + 2.0
        report_closed_at = None
        pid_seen = False
        with selectors.DefaultSelector() as selector:
            for stream in streams:
                selector.register(stream.fd, selectors.EVENT_READ, stream)
            while any(s.open for s in streams):
                now = time.monotonic()
                if now >= deadline or (report_closed_at is not None and now - report_closed_at > 0.5):
                    break
                for key, _ in selector.select(timeout=min(deadline - now, 0.1)):
                    key.data.read(selector)
                if not pid_seen and b"\n" in report.data:
                    # The candidate's pid, from the supervisor, before any untrusted code ran: a pidfd to it
                    # lets the cleanup below kill it even if it left the process group.
                    pid_seen = True
                    candidate_pidfd = _pidfd(_first_record(report.data).get("candidate_pid"))
                if not report.open and report_closed_at is None:
                    report_closed_at = time.monotonic()
    finally:
        if proc is not None:
            _kill_group(proc.pid)
            if candidate_pidfd is not None:
                _pidfd_kill(candidate_pidfd)
            proc.wait()
        for fd in (result_w, report_w):
            if fd >= 0:
                os.close(fd)
        for stream in streams:
            stream.close()
        _remove_tree(own_dir)
    return _result(exprs, output, results, report, time.monotonic() - started)


def _result(exprs, output: _Stream, results: _Stream, report: _Stream, wall_s: float) -> SandboxResult:
    records = {}
    for line in bytes(report.data).splitlines():
        try:
            records.update(json.loads(line))
        except ValueError:
            pass
    supervisor_error = None
    if "exit_code" not in records:
        supervisor_error = ("the supervisor did not report an exit (killed at the caller's deadline); output: "
                            + bytes(output.data[-400:]).decode(errors="replace"))
    isolation = Isolation.from_report(records["isolation"]) if "isolation" in records else None
    outcomes, load_error = _parse_outcomes(bytes(results.data).splitlines(), len(exprs))
    text = bytes(output.data).decode(errors="replace")
    if output.overflow:
        text += "\n[output truncated]"
    return SandboxResult(outcomes=tuple(outcomes), load_error=load_error, output=text,
                         timed_out=bool(records.get("timed_out", supervisor_error is not None)),
                         disk_exceeded=bool(records.get("disk_exceeded", False)),
                         exit_code=records.get("exit_code"), isolation=isolation, wall_s=wall_s,
                         supervisor_error=supervisor_error, output_truncated=output.overflow)


def _first_record(data: bytearray) -> dict:
    try:
        record = json.loads(bytes(data).split(b"\n", 1)[0])
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _pidfd(pid) -> int | None:
    if type(pid) is not int or pid <= 0:
        return None
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _pidfd_kill(pidfd: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except (AttributeError, OSError):
        pass
    os.close(pidfd)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


SHELL = "/bin/bash"
SHELL_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8", "TERM": "dumb"}


def make_workdir(prefix: str = "hybridtron-task-") -> Path:
    """A fresh directory for `run_python(..., workdir=)` / `run_shell`, to fill with a task's files and then hand
    over with `hand_over(path)`; the caller removes it (`remove_workdir`)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    return path


def new_run_as() -> int:
    """A user id for one trajectory's sandboxed calls (`run_python(run_as=)`), unused by the system's accounts."""
    return random.randrange(*RUN_AS_RANGE)


def hand_over(workdir: str | os.PathLike, run_as: int | None = None) -> None:
    """Make a task directory the candidate's: under a root parent the candidate runs as `run_as` (default nobody),
    which must own what it may change (a non-root parent's candidate keeps its uid, mapped to root in its user
    namespace)."""
    if os.getuid() != 0:
        return
    user = run_as or NOBODY
    for parent, dirs, files in os.walk(workdir):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(parent, name), user, user)
    os.chown(workdir, user, user)


def remove_workdir(workdir: str | os.PathLike) -> None:
    _remove_tree(str(workdir))


def run_shell(command: str, workdir: str | os.PathLike, config: SandboxConfig = SandboxConfig(), *,
              run_as: int | None = None) -> SandboxResult:
    """`bash -c command` in the sandbox, working in `workdir` (kept between calls): the sandbox's candidate process
    replaces itself with bash, so every protection and limit applies to bash and what it starts; its exit status is
    the result's `exit_code`, its stdout and stderr the `output`."""
    source = (f"import os\nos.execve({SHELL!r}, ['bash', '-c', {command!r}], "
              f"{{**{SHELL_ENV!r}, 'HOME': os.getcwd(), 'PWD': os.getcwd()}})")
    return run_python(source, [], config, workdir=workdir, run_as=run_as)


def run_tests(source: str, tests: Sequence[str | UnitTest], config: SandboxConfig = SandboxConfig()) -> TestReport:
    """Run `source` against hidden tests; a test passes when its expression's value equals the expected."""
    parsed = [t if isinstance(t, UnitTest) else parse_test(t) for t in tests]
    result = run_python(source, [t.expr for t in parsed], config)
    passed = []
    for test, outcome in zip(parsed, result.outcomes):
        ok = False
        if outcome is not None and outcome.error is None:
            try:  # plain data of our own decoding on both sides: Python's == is the assert's own semantics
                ok = bool(outcome.value == test.expected)
            except Exception:  # noqa: BLE001 - e.g. a RecursionError on a deeply nested value
                ok = False
        passed.append(ok)
    _note_isolation(result.isolation)
    return TestReport(passed=tuple(passed), result=result)


_warned: set[str] = set()


def _note_isolation(isolation: Isolation | None) -> None:
    """Say once per process which protections this kernel refused (the run itself goes on)."""
    if isolation is None:
        return
    missing = isolation.missing()
    if missing and isolation.summary() not in _warned:
        _warned.add(isolation.summary())
        log.warning("sandbox: %s; not held on this machine: %s", isolation.summary(), "; ".join(missing))


@functools.lru_cache(maxsize=4)
def probe(config: SandboxConfig = SandboxConfig()) -> Isolation:
    """Which protections this machine allows: one empty run, cached per config."""
    result = run_python("", [], config)
    if result.isolation is None:
        raise RuntimeError(f"sandbox supervisor failed: {result.supervisor_error}")
    return result.isolation
