"""The sandbox's runner: executed as `python -I -S sandbox_runner.py`, standard library only.

Two processes, one trusted and one not:

- the *supervisor* (this script's first process) reads the job from stdin, unshares new PID, network, IPC
  and UTS namespaces (and, for a parent that is not root, a user namespace mapping only its own id),
  forks the candidate process, holds the wall clock, kills the candidate and every descendant at the
  deadline, and reports to the parent on a channel the candidate never holds (`report_fd`): the
  candidate's pid, which protections held, and how it ended;
- the *candidate* process (pid 1 of the new PID namespace) enters a mount namespace of its own, builds a
  root file system (read-only binds of the Python installation and the system libraries, a size-capped
  tmpfs as its working directory, a few device nodes, a fresh /proc), pivots into it and detaches the old
  root, sets no_new_privs, becomes `nobody` if the parent was root, empties every capability set, applies
  Landlock, sets the resource limits, closes every other descriptor, and only then runs the untrusted
  source and evaluates each test's expression, writing one JSON line per expression to `result_fd`.

Nothing the candidate process writes is believed: it reports *values*, and the parent compares them with
expected values that never enter the sandbox. Forging the result channel, exiting early, overriding
builtins or printing a success line can at best report wrong values, which score 0.

Each protection is attempted and its outcome reported; a step the kernel refuses is recorded in
`isolation["errors"]` and the run goes on with the protections that did hold.
"""

import ctypes
import errno
import json
import os
import resource
import select
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME = 16384, 1 << 18, 1 << 21
MNT_DETACH = 2

PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
PR_SET_CHILD_SUBREAPER, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 36, 47, 4

SYSCALLS = {  # per machine (glibc wraps none of these); the Landlock calls share one number everywhere
    "x86_64": {"pivot_root": 155, "capget": 125, "capset": 126},
    "aarch64": {"pivot_root": 41, "capget": 90, "capset": 91},
}
CAP_VERSION_3 = 0x20080522
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446

NOBODY = 65534  # what a root parent's candidate becomes: RLIMIT_NPROC never binds root
DEVICES = ("null", "zero", "full", "random", "urandom")
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
MAX_ENCODED_DEPTH = 64

libc = ctypes.CDLL(None, use_errno=True)


class KernelRefused(OSError):
    pass


def check(result, what):
    if result == -1:
        code = ctypes.get_errno()
        raise KernelRefused(code, f"{what}: {errno.errorcode.get(code, code)}")
    return result


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          f"mount {fstype or source} on {target}")


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


# ---------------------------------------------------------------------------------------------- supervisor


def enter_namespaces(isolation):
    """unshare() in the supervisor: the new network, IPC and UTS (and user) namespaces apply to it at once,
    the PID namespace to the candidate it forks next; the candidate makes its own mount namespace, so that
    its pivot_root leaves the supervisor's view of the host (and /proc) alone. Returns how the candidate
    drops its identity:

    - "root": a root parent needs no user namespace; the candidate becomes `nobody` after its mounts (a
      process inside a new user namespace could map only its own id, and RLIMIT_NPROC never binds root);
    - "userns": anyone else enters a new user namespace mapping only their own id to 0 inside; the candidate
      keeps that id outside and loses every capability;
    - "none": the kernel refused; only Landlock and the resource limits remain.
    """
    uid, gid = os.getuid(), os.getgid()
    others = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if uid == 0:
        if libc.unshare(others) == 0:
            isolation.update(pid_ns=True, net_ns=True, ipc_ns=True)
            return "root"
        isolation["errors"].append(f"unshare(pid|net|ipc|uts): {errno.errorcode.get(ctypes.get_errno())}")
    if libc.unshare(CLONE_NEWUSER | others) != 0:
        isolation["errors"].append(
            f"unshare(user|pid|net|ipc|uts): {errno.errorcode.get(ctypes.get_errno())}")
        return "none"
    isolation.update(user_ns=True, pid_ns=True, net_ns=True, ipc_ns=True)
    try:
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"0 {uid} 1")
        write_file("/proc/self/gid_map", f"0 {gid} 1")
    except OSError as e:
        isolation["errors"].append(f"uid/gid map: {e}")
    return "userns"


def read_proc_children(pid):
    """Direct children of `pid`, from /proc (the supervisor is a subreaper, so orphans land here)."""
    children = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if int(fields[1]) == pid:
            children.append(int(name))
    return children


def reap_children():
    """Collect exited children; False once there are none left at all."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def kill_descendants():
    """After the candidate died: kill whatever it left behind (only possible without a PID namespace)."""
    me = os.getpid()
    for _ in range(1000):
        if not reap_children():
            return
        children = read_proc_children(me)
        if not children:
            return
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)


def disk_usage(path, max_entries=20000):
    """Bytes allocated below `path`; infinite past `max_entries` files (a tree too big to watch is too big)."""
    total, entries, stack = 0, 0, [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    entries += 1
                    if entries > max_entries:
                        return float("inf")
                    st = entry.stat(follow_symlinks=False)
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except OSError:
            continue
    return total


def wait_with_deadline(pid, deadline, watch_dir=None, disk_bytes=0):
    """Wait for the candidate's exit; SIGKILL it at the deadline, or once `watch_dir` holds more than
    `disk_bytes` (the watch stands in for the tmpfs cap where there is no mount namespace).
    Returns (exit status, how it was stopped: None, "timeout" or "disk")."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    stopped = None
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            break
        remaining = deadline - time.monotonic()
        if stopped is None and watch_dir is not None and disk_usage(watch_dir) > disk_bytes:
            stopped = "disk"
        elif stopped is None and remaining <= 0:
            stopped = "timeout"
        if stopped is not None:
            os.kill(pid, signal.SIGKILL)  # in a PID namespace this ends every process in it
            remaining = 1.0
        wait = min(max(remaining, 0), 0.01) if watch_dir is not None else max(remaining, 0)
        if pidfd is not None:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.poll(wait * 1000)
        else:
            time.sleep(min(wait, 0.005))
    if pidfd is not None:
        os.close(pidfd)
    return os.waitstatus_to_exitcode(status), stopped


def send(fd, record):
    os.write(fd, (json.dumps(record) + "\n").encode())


def supervise(job):
    report_fd = job["report_fd"]
    isolation = {"user_ns": False, "pid_ns": False, "net_ns": False, "ipc_ns": False, "mount_ns": False,
                 "proc": False, "caps_dropped": False, "no_new_privs": False, "landlock_abi": 0,
                 "landlock": False, "outer_uid": os.getuid(), "errors": []}
    mode = enter_namespaces(isolation) if job["namespaces"] else "none"
    if mode == "none" and job["namespaces"] is False:
        isolation["errors"].append("namespaces disabled by the caller")
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    setup_r, setup_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(report_fd)
            os.close(setup_r)
            candidate(job, mode, isolation, setup_w)
        finally:
            os._exit(70)
    os.close(setup_w)
    send(report_fd, {"candidate_pid": pid})
    # The setup (mounts, limits) is our own code and takes milliseconds; the wall clock starts after it.
    setup = b""
    setup_deadline = time.monotonic() + job["setup_s"]
    while True:
        ready, _, _ = select.select([setup_r], [], [], max(setup_deadline - time.monotonic(), 0))
        if not ready:
            break
        chunk = os.read(setup_r, 65536)
        if not chunk:
            break
        setup += chunk
    os.close(setup_r)
    try:
        isolation = json.loads(setup)
    except ValueError:
        isolation["errors"].append("the candidate process died during setup")
    send(report_fd, {"isolation": isolation})
    started = time.monotonic()
    # a caller's directory is the host's (no tmpfs caps it): watched like the working directory without a mount
    # namespace
    watch_dir = job.get("workdir") or (None if isolation.get("mount_ns") else os.getcwd())
    status, stopped = wait_with_deadline(pid, started + job["wall_s"], watch_dir,
                                         job["limits"]["disk_mb"] << 20)
    if isolation.get("pid_ns"):
        reap_children()  # the PID namespace died with its first process: only zombies are left
    else:
        kill_descendants()
    # out of CPU seconds (RLIMIT_CPU's SIGXCPU, or its hard-limit SIGKILL that nobody here sent) is a timeout too
    out_of_cpu = stopped is None and status in (-signal.SIGXCPU, -signal.SIGKILL)
    send(report_fd, {"exit_code": status, "timed_out": stopped == "timeout" or out_of_cpu,
                     "disk_exceeded": stopped == "disk",
                     "wall_s": time.monotonic() - started})


# ---------------------------------------------------------------------------------------- candidate: setup


def mount_flags_of(path):
    """Flags a remount must keep: in a user namespace the kernel locks nosuid/nodev/noexec/atime."""
    f = os.statvfs(path).f_flag
    flags = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                   (getattr(os, "ST_RELATIME", 4096), MS_RELATIME)):
        if f & st:
            flags |= ms
    return flags


def bind_readonly(source, root):
    target = root + source
    if os.path.islink(source):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(source), target)
        return
    os.makedirs(target, exist_ok=True)
    mount(source, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | mount_flags_of(target))


def open_to_others(path):
    """Whether a user with no relation to the file's owner can reach and read `path`."""
    parts = path.rstrip("/").split("/")
    for i in range(1, len(parts) + 1):
        mode = os.stat("/".join(parts[:i]) or "/").st_mode
        if not mode & 0o001 or (i == len(parts) and not mode & 0o004):
            return False
    return True


def python_dirs():
    """Directories the interpreter reads after start: its installation and every import path."""
    dirs = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    for entry in sys.path:
        if entry and os.path.exists(entry):
            dirs.add(os.path.realpath(entry if os.path.isdir(entry) else os.path.dirname(entry)))
    return dirs


def build_root(root, disk_mb, work_source=None):
    """A new root: tmpfs with read-only binds of the system and Python, /work (tmpfs, `disk_mb`; or a bind of the
    caller's `work_source`, a directory kept between runs), /dev nodes, a fresh /proc. The old root is detached
    after pivot_root, so no other path of the host is reachable."""
    check(libc.unshare(CLONE_NEWNS), "unshare(mount)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    sources = [d for d in SYSTEM_DIRS if os.path.lexists(d)]
    for d in sorted(python_dirs(), key=len):
        if not any(d == s or d.startswith(s.rstrip("/") + "/") for s in sources):
            sources.append(d)
    for source in sources:
        bind_readonly(source, root)
    os.makedirs(root + "/dev")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            open(f"{root}/dev/{name}", "w").close()
            mount("/dev/" + name, f"{root}/dev/{name}", None, MS_BIND)
    os.makedirs(root + "/work")
    if work_source:
        mount(work_source, root + "/work", None, MS_BIND)
        mount(None, root + "/work", None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | mount_flags_of(root + "/work"))
    else:
        mount("tmpfs", root + "/work", "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,mode=0777")
    os.symlink("/work", root + "/tmp")
    os.makedirs(root + "/proc")
    proc = True
    try:
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except KernelRefused:
        proc = False  # a masked /proc (e.g. some containers): the candidate then sees no /proc at all
    os.makedirs(root + "/.oldroot")
    numbers = SYSCALLS.get(os.uname().machine)
    if numbers is None:
        raise KernelRefused(errno.ENOSYS, f"pivot_root: unknown machine {os.uname().machine}")
    check(libc.syscall(numbers["pivot_root"], root.encode(), (root + "/.oldroot").encode()), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.oldroot", MNT_DETACH), "umount old root")
    os.rmdir("/.oldroot")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir("/work")
    return proc


def forbid_new_privileges():
    """No exec may ever grant a capability again: no_new_privs, an empty bounding set, no ambient set.
    Emptying the bounding set needs CAP_SETPCAP, so this comes before the switch to nobody."""
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if capabilities_empty():
        return  # an unprivileged process outside a user namespace: nothing to drop, nor the right to drop it
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == -1:
            if ctypes.get_errno() == errno.EINVAL:  # past the last capability this kernel knows
                break
            raise KernelRefused(ctypes.get_errno(), "drop the capability bounding set")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)


def _capabilities(op, data):
    numbers = SYSCALLS.get(os.uname().machine)
    if numbers is None:
        raise KernelRefused(errno.ENOSYS, f"{op}: unknown machine {os.uname().machine}")
    header = (ctypes.c_uint32 * 2)(CAP_VERSION_3, 0)  # this process
    check(libc.syscall(numbers[op], header, data), op)


def clear_capabilities():
    """Effective, permitted and inheritable sets all empty (a user namespace's creator holds them all)."""
    _capabilities("capset", (ctypes.c_uint32 * 6)())


def capabilities_empty():
    """Whether this process holds no capability at all (effective, permitted, inheritable; two words each)."""
    data = (ctypes.c_uint32 * 6)()
    _capabilities("capget", data)
    return not any(data)


def landlock(workdir):
    """Landlock (an unprivileged LSM, Linux >= 5.13): reads only of the Python installation, the system
    libraries and a few devices; writes only below `workdir` (and to /dev/null); no TCP bind or connect
    (ABI >= 4); no signals to, or abstract sockets of, processes outside (ABI >= 6). Returns the ABI
    applied, 0 where the kernel has no Landlock."""
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return 0
    read = 1 | 4 | 8  # execute, read file, read dir
    write = 2 | 16 | 32 | 64 | 128 | 256 | 512 | 1024 | 2048 | 4096  # write file, remove *, make *
    write |= (8192 if abi >= 2 else 0) | (16384 if abi >= 3 else 0)  # refer, truncate
    attr = (ctypes.c_uint64 * 3)(read | write, 1 | 2 if abi >= 4 else 0, 1 | 2 if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = check(libc.syscall(SYS_LANDLOCK_CREATE_RULESET, attr, size, 0), "landlock_create_ruleset")

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    file_write = 2 | (16384 if abi >= 3 else 0)
    rules = [(workdir, read | write), ("/dev/null", 4 | file_write), ("/dev/zero", 4), ("/dev/full", 4),
             ("/dev/random", 4), ("/dev/urandom", 4)]
    rules += [(d, read) for d in python_dirs() | {d for d in SYSTEM_DIRS if os.path.isdir(d)}]
    for path, access in rules:
        if not os.path.exists(path):
            continue
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = PathBeneath(access, fd)
        check(libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0), f"landlock rule {path}")
        os.close(fd)
    check(libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    os.close(ruleset)
    return abi


def count_processes_of(uid):
    count = 0
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
                count += 1
        except OSError:
            pass
    return count


def set_limits(limits, processes_already):
    mb = 1 << 20
    cpu = limits["cpu_s"]
    for kind, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                        (resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2),
                        (resource.RLIMIT_NPROC, (processes_already + limits["processes"],) * 2),
                        (resource.RLIMIT_FSIZE, (limits["file_mb"] * mb,) * 2),
                        (resource.RLIMIT_NOFILE, (limits["open_files"],) * 2),
                        (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(kind, value)


def candidate(job, mode, isolation, setup_w):
    """Runs in the forked child: isolate, then hand over to the untrusted code. Never returns."""
    result_fd = job["result_fd"]
    workdir = os.getcwd()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # Without a user namespace RLIMIT_NPROC counts every process of the candidate's user: leave room for
    # those (counted now, while /proc is still the host's).
    user = (job.get("run_as") or NOBODY) if job["parent_uid"] == 0 else os.getuid()
    processes_already = 0 if mode == "userns" else count_processes_of(user)
    if mode != "none":
        try:
            isolation["proc"] = build_root(workdir, job["limits"]["disk_mb"], job.get("workdir"))
            isolation["mount_ns"] = True
            workdir = "/work"
        except OSError as e:
            isolation["errors"].append(f"private root: {e}")
            os.chdir(workdir)
    if not isolation["mount_ns"] and job.get("workdir"):
        workdir = job["workdir"]
        os.chdir(workdir)
    try:
        forbid_new_privileges()
        isolation["no_new_privs"] = True
    except OSError as e:
        isolation["errors"].append(str(e))
    hidden = [] if isolation["mount_ns"] else [d for d in sorted(python_dirs()) if not open_to_others(d)]
    if job["parent_uid"] == 0 and hidden:
        # Without a private root, nobody could not import the rest of the standard library: stay root, but
        # without any capability (RLIMIT_NPROC then does not bind; Landlock still confines files).
        isolation["errors"].append(f"switch to nobody: {hidden[0]} is not readable by others")
    elif job["parent_uid"] == 0:
        try:
            if not isolation["mount_ns"]:
                os.chown(workdir, user, user)
            os.setgroups([])
            os.setresgid(user, user, user)
            os.setresuid(user, user, user)  # from root to nobody: every capability goes with it
            isolation["outer_uid"] = user
        except OSError as e:
            isolation["errors"].append(f"switch to nobody: {e}")
    try:
        clear_capabilities()
    except OSError as e:
        isolation["errors"].append(str(e))
    try:
        isolation["caps_dropped"] = capabilities_empty()
    except OSError as e:
        isolation["errors"].append(str(e))
    if job["landlock"]:
        try:
            isolation["landlock_abi"] = landlock(workdir)
            isolation["landlock"] = isolation["landlock_abi"] > 0
        except OSError as e:
            isolation["errors"].append(f"landlock: {e}")
    if os.path.exists("/dev/null"):
        devnull = os.open("/dev/null", os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
    keep = sorted({result_fd, setup_w})
    os.closerange(3, keep[0])
    os.closerange(keep[0] + 1, keep[1])
    os.closerange(keep[1] + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    set_limits(job["limits"], processes_already)
    os.write(setup_w, json.dumps(isolation).encode())
    os.close(setup_w)
    run_untrusted(job["source"], job["exprs"], result_fd, job["max_value_bytes"])
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - a closed or replaced stream: nothing left to save
            pass
    os._exit(0)


# ------------------------------------------------------------------------------------ candidate: untrusted


def encode(value, depth=0):
    """Plain data as JSON with exact types kept (tuples, sets, dict keys, floats by repr). Only the exact
    built-in types count: a subclass could lie through __eq__ or __repr__."""
    if depth > MAX_ENCODED_DEPTH:
        raise ValueError("value nested too deeply")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return {"i": str(value)} if abs(value) >= 1 << 53 else value
    if kind is float:
        return {"f": repr(value)}
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"t": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        return {"s" if kind is set else "fs": [encode(v, depth + 1) for v in value]}
    if kind is bytes:
        return {"b": value.hex()}
    raise TypeError(f"unsupported result type {kind.__name__}")


def run_untrusted(source, exprs, result_fd, max_value_bytes):
    """From here on anything may be patched by the candidate; it can only change the values reported."""
    write = os.write
    scope = {"__name__": "__candidate__", "__builtins__": __builtins__}

    def report(record):
        line = (json.dumps(record) + "\n").encode()
        if len(line) > max_value_bytes:
            line = (json.dumps({"i": record.get("i"), "error": "value too large"}) + "\n").encode()
        write(result_fd, line)

    try:
        exec(compile(source, "<candidate>", "exec"), scope)
    except BaseException as e:  # noqa: BLE001 - SystemExit included: an early exit reports no values
        report({"load_error": f"{type(e).__name__}: {e}"[:500]})
        return
    for i, expr in enumerate(exprs):
        try:
            value = encode(eval(compile(expr, f"<test {i}>", "eval"), scope))
            report({"i": i, "value": value})
        except BaseException as e:  # noqa: BLE001
            report({"i": i, "error": f"{type(e).__name__}: {e}"[:500]})


def main():
    job = json.loads(sys.stdin.buffer.read())
    job["parent_uid"] = os.getuid()
    supervise(job)


if __name__ == "__main__":
    main()
