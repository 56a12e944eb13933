"""The code sandbox holds against candidates that cheat or attack, and the trainer's process survives them.

Each attack runs twice: with the namespaces this kernel allows, and with namespaces switched off (what a
machine without user namespaces gets: Landlock and resource limits only). A protection that only a namespace
gives is asserted where `probe()` says it held, and skipped with the reason elsewhere.
"""

import dataclasses
import os
import signal
import socket
import subprocess
import time

import pytest

from hybridtron.envs.sandbox import SandboxConfig, parse_test, probe, run_python, run_tests

FAST = dict(wall_s=1.0, cpu_s=1, setup_s=3.0)
CONFIGS = {"namespaces": SandboxConfig(**FAST), "fallback": SandboxConfig(namespaces=False, **FAST)}
TESTS = ["assert f(1) == 917", "assert f(2) == 918", "assert f(-5) == 911"]
RIGHT = "def f(x):\n    return x + 916\n"


@pytest.fixture(params=sorted(CONFIGS))
def config(request):
    return CONFIGS[request.param]


def score(source, config, tests=TESTS):
    return run_tests(source, tests, config)


def test_scores_values_not_claims(config):
    assert score(RIGHT, config).share == 1.0
    assert score("def f(x):\n    return 917\n", config).share == pytest.approx(1 / 3)
    report = score("def f(x):\n    return x / 0\n", config)
    assert report.share == 0.0
    assert all("ZeroDivisionError" in o.error for o in report.result.outcomes)


def test_values_keep_their_types(config):
    exprs = ["(1, 2)", "[1, (2, 3)]", "{1: 'a'}", "{3}", "frozenset({4})", "b'x'", "0.1 + 0.2", "2 ** 80",
             "None", "True", "float('inf')"]
    result = run_python("", exprs, config)
    assert [o.value for o in result.outcomes] == [(1, 2), [1, (2, 3)], {1: "a"}, {3}, frozenset({4}), b"x",
                                                  0.1 + 0.2, 2 ** 80, None, True, float("inf")]
    assert type(result.outcomes[0].value) is tuple
    assert run_tests("def f():\n    return [1, 2]\n", ["assert f() == (1, 2)"], config).share == 0.0


def test_unit_tests_must_keep_the_expected_value_outside():
    assert parse_test("assert f([1, 2]) == [2, 1]").expected == [2, 1]
    with pytest.raises(ValueError, match="assert EXPR == LITERAL"):
        parse_test("assert f(1) > 2")
    with pytest.raises(ValueError, match="must be a literal"):
        parse_test("assert f(1) == g(2)")
    with pytest.raises(ValueError, match="not valid Python"):
        parse_test("assert f(")


@pytest.mark.parametrize("source", [
    "import sys\nsys.exit(0)\n",
    "import os\nos._exit(0)\n",
    "raise SystemExit(0)\n",
    "print('OK: all 3 tests passed')\nprint('{\"i\": 0, \"value\": 917}')\ndef f(x):\n    return None\n",
], ids=["sys.exit", "os._exit", "SystemExit", "fake-success-line"])
def test_early_exit_or_a_printed_verdict_scores_zero(config, source):
    assert score(source, config).share == 0.0


def test_overridden_builtins_and_a_patched_harness_score_zero(config):
    source = """
import builtins, json, os, sys
class AlwaysEqual(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
def f(x):
    return AlwaysEqual(0)
builtins.eval = lambda *a, **k: AlwaysEqual(0)
builtins.isinstance = lambda *a: True
builtins.AssertionError = type('Never', (Exception,), {})
json.dumps = lambda *a, **k: '{"i": 0, "value": true}'
for fd in range(3, 64):  # forge records on every descriptor: they can only carry guessed values
    for i in range(3):
        try:
            os.write(fd, b'{"i": %d, "value": 1}\\n' % i)
        except OSError:
            pass
sys.modules['__main__'].encode = lambda value, depth=0: 917
"""
    assert score(source, config).share == 0.0


SEARCH_MEMORY = """
import gc
PREFIX = "SEC" + "RET-"  # built at run time, so that this source holds no string with the prefix
def f():
    for obj in gc.get_objects():  # every container the interpreter tracks: the job, the harness's locals
        values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
        for v in list(values):
            if isinstance(v, str) and v.startswith(PREFIX) and v != PREFIX:
                return v
    return None
"""


def test_expected_values_never_enter_the_sandbox(config):
    planted = run_python(SEARCH_MEMORY + "planted = [PREFIX + 'planted']\n", ["f()"], config)
    assert planted.outcomes[0].value == "SECRET-planted"  # the search does find what is there
    assert score(SEARCH_MEMORY, config, tests=["assert f() == 'SECRET-917'"]).share == 0.0


def test_infinite_loop_is_killed_at_the_wall_clock(config):
    start = time.monotonic()
    report = score("def f(x):\n    while True:\n        pass\n", config)
    assert report.share == 0.0 and report.result.timed_out
    assert time.monotonic() - start < config.wall_s + 2.0
    sleeper = score("import time\ntime.sleep(60)\n", config)  # no CPU used: only the wall clock stops it
    assert sleeper.result.timed_out and sleeper.share == 0.0


def test_tests_passed_before_a_hang_still_count(config):
    source = "def f(x):\n    while x < 0:\n        pass\n    return x + 916\n"
    report = score(source, config)
    assert report.passed == (True, True, False) and report.result.timed_out


def leftover_processes(marker):
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


def test_fork_bomb_is_bounded_and_leaves_nothing_behind(config):
    if probe(config).outer_uid == 0:
        pytest.skip("the candidate stays root here (Python is not readable by nobody): RLIMIT_NPROC does not bind")
    marker = f"forkbomb-{os.getpid()}-{time.monotonic_ns()}"
    source = f"""
import os, time
MARK = {marker!r}
def f(x):
    return x + 916
children = 0
deadline = time.monotonic() + 0.5
while time.monotonic() < deadline:
    try:
        if os.fork() == 0:
            os.setsid()  # try to leave the process group
            while True:
                time.sleep(1)
        children += 1
    except OSError:
        pass
print("children", children)
"""
    report = score(source, config)
    assert report.share == 1.0  # it did compute f; the bomb itself was contained
    children = int(report.result.output.split()[-1])
    assert 0 < children < config.processes + 2
    time.sleep(0.1)
    assert leftover_processes(marker.encode()) == []
    assert subprocess.run(["true"]).returncode == 0  # the trainer can still fork


def test_huge_output_is_capped(config):
    start = time.monotonic()
    source = ("import sys\nwhile True:\n    try:\n        sys.stdout.write('x' * 65536)\n"
              "    except Exception:\n        pass\n")
    report = score(source, config)
    assert report.share == 0.0
    assert len(report.result.output) <= config.output_bytes + 100
    assert time.monotonic() - start < config.wall_s + 2.0


def test_memory_hog_gets_memory_error(config):
    report = run_python("x = bytearray(8 << 30)\n", [], config)
    assert "MemoryError" in report.load_error


def test_files_outside_its_directory_are_neither_written_nor_read(config, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("safe")
    escapes = [str(tmp_path / "escape.txt"), f"/tmp/hybridtron-escape-{os.getpid()}", "/root/escape.txt",
               os.path.expanduser("~/hybridtron-escape.txt")]
    source = f"""
import os
attempts = {escapes!r}
for path in attempts:
    try:
        with open(path, 'w') as out:
            out.write('escaped')
    except OSError:
        pass
for action in (lambda: os.remove({str(victim)!r}), lambda: open({str(victim)!r}, 'w').write('pwned')):
    try:
        action()
    except OSError:
        pass
with open('inside.txt', 'w') as out:  # its own directory is writable
    out.write('fine')
def read(path):
    try:
        return open(path).read()
    except OSError as e:
        return type(e).__name__
"""
    trainer = f"/proc/{os.getpid()}/cmdline"
    result = run_python(source, ["open('inside.txt').read()", f"read({str(victim)!r})", f"read({trainer!r})"],
                        config)
    assert result.load_error is None
    assert result.outcomes[0].value == "fine"
    assert result.outcomes[1].value != "safe"  # other files are not even readable
    assert result.outcomes[2].value in ("PermissionError", "FileNotFoundError")  # nor the trainer's /proc
    assert victim.read_text() == "safe"
    for path in escapes:
        assert not os.path.exists(path), path


def test_filling_the_disk_is_bounded(config):
    big = "with open('big', 'wb') as out:\n    for _ in range(200):\n        out.write(b'x' * (1 << 20))\n"
    report = score(big + RIGHT, config)
    assert report.share == 0.0  # RLIMIT_FSIZE: SIGXFSZ ends it before it defines f
    many = ("for i in range(100):\n    try:\n        with open(f'f{i}', 'wb') as out:\n"
            "            out.write(b'x' * (8 << 20))\n        print(i + 1, flush=True)\n    except OSError:\n"
            "        break\n")
    result = run_python(many, [], config)
    written_mb = 8 * int(result.output.split()[-1])
    # The tmpfs working directory caps the total; without one the supervisor watches it and kills past the cap.
    assert written_mb <= config.disk_mb + 2 * config.file_mb, result
    assert result.disk_exceeded or probe(config).mount_ns


def test_killing_the_parent_or_the_trainer_fails(config):
    decoy = subprocess.Popen(["sleep", "30"])
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        source = f"""
import os, signal
def attempt(fn):
    try:
        fn()
    except OSError:
        pass
attempt(lambda: os.kill(os.getppid(), signal.SIGKILL))
attempt(lambda: os.kill({os.getpid()}, signal.SIGUSR1))
attempt(lambda: os.kill({decoy.pid}, signal.SIGKILL))
attempt(lambda: os.kill(-1, signal.SIGKILL))
def f(x):
    return 0
"""
        report = score(source, config)
        time.sleep(0.1)
        assert report.share == 0.0
        assert decoy.poll() is None, "the candidate killed a process outside the sandbox"
        assert received == [], "the candidate signalled the trainer"
        assert score(RIGHT, config).share == 1.0  # the sandbox still works afterwards
    finally:
        signal.signal(signal.SIGUSR1, previous)
        decoy.kill()
        decoy.wait()


CONNECT = """
import errno, socket
def connect(port):
    try:
        socket.create_connection(('127.0.0.1', port), timeout=0.5).close()
        return 'connected'
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
"""


def test_network_is_unreachable(config):
    """Both layers are tried alone: the network namespace (only a loopback that is down) and Landlock's TCP
    rule; each must stop a connection to a server listening on the host's loopback."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    layers = {}
    if probe(CONFIGS["fallback"]).landlock_abi >= 4:
        layers["landlock"] = dataclasses.replace(config, namespaces=False)
    if config.namespaces and probe(config).net_ns:
        layers["net namespace"] = dataclasses.replace(config, landlock=False)
    if not layers:
        server.close()
        pytest.skip("neither a network namespace nor Landlock ABI >= 4 on this kernel: the network is open")
    try:
        for layer, layer_config in layers.items():
            result = run_python(CONNECT, [f"connect({port})"], layer_config)
            assert result.outcomes[0].value in ("EACCES", "ENETUNREACH"), (layer, result.outcomes)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # no connection is waiting in the backlog
            server.accept()
    finally:
        server.close()


def test_probe_reports_what_held():
    isolation = probe(CONFIGS["namespaces"])
    assert isolation.caps_dropped and isolation.no_new_privs
    assert isolation.outer_uid != 0
    fallback = probe(CONFIGS["fallback"])
    assert not fallback.net_ns and "namespaces disabled by the caller" in fallback.errors
    assert any("network namespace" in m for m in fallback.missing())


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="SandboxConfig.wall_s must be > 0"):
        SandboxConfig(wall_s=0)
