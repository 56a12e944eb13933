"""Shared compile caches: torch.compile's own on-disk caches, pointed at one directory that runs and ranks share.

`use_compile_cache(DIR)` (`train.compile_cache`, `generate --compile-cache`, `serve --compile-cache`) makes every
compile of this process read and write its artifacts in DIR: inductor's FX graph cache (the generated code and the
built C++/Triton kernels of each graph, keyed by the graph, its input shapes, the inductor config and the torch
version) and the AOTAutograd cache (the joint forward/backward graphs around them). The first run that compiles a
graph fills DIR; every later run, and every rank of a torchrun launch, that compiles the same graph loads it from
there instead (torch's counters `fxgraph_cache_hit` / `autograd_cache_hit` count the loads). Both caches are on by
default in torch; what this module changes is only where they live: torch's default, /tmp/torchinductor_$USER,
belongs to one user on one machine and is lost with /tmp.

Why the directory cache and not torch's portable "mega-cache" (`torch.compiler.save_cache_artifacts` /
`load_cache_artifacts`): that API serializes one process's artifacts into bytes for a store of the caller's own;
with a directory every process both reads and adds, with no step to collect and merge the artifacts of the ranks or
of runs that compiled other graphs. To start another machine warm, copy the directory (the keys carry the torch
version and, for GPUs, the device; an entry that does not match is a miss, never a wrong kernel).

Several writers at once are safe by torch's design (torch 2.13: `torch._inductor.codecache`, and
`torch._functorch._aot_autograd.autograd_cache`): an entry is written to a temporary file named by the process and
thread and renamed into place (`write_atomic`), under the hash of its content in a directory per cache key, and a
lookup tries every entry of its key and skips the temporary files. A reader sees a whole entry or none, and two ranks
that compile the same graph at once both succeed, leaving one entry or two equivalent ones; the C++ kernels are
built under a file lock in DIR/locks. Nothing here writes into DIR but the probe that checks it can be written.

A directory that cannot be created or written is not an error: the run goes on with torch's default cache and the
returned line says so (the caller prints it, under torchrun on rank 0 alone).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

# inductor reads its cache directory from this variable at each use (torch._inductor.runtime.cache_dir_utils), and
# its compile worker subprocesses inherit it: the one setting the cache needs, so the one this module changes.
# Triton's kernel cache (GPU) follows it unless TRITON_CACHE_DIR is set, and inductor bundles those kernels into
# the FX graph cache's entries anyway.
CACHE_DIR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def use_compile_cache(directory: str | os.PathLike) -> str | None:
    """Make torch.compile's on-disk caches live in `directory` (created if missing) for the rest of this process;
    call it before the first compile. Returns None when the cache is in use, else one line saying why it is not
    (the directory cannot be written, or torch's caches are switched off) and that compiles go on without it."""
    path = Path(directory).expanduser().absolute()
    if torch.compiler.config.force_disable_caches or not torch._inductor.config.fx_graph_cache:
        return (f"warning: compile cache {path} unused: torch's compile caches are switched off "
                f"(TORCHINDUCTOR_FORCE_DISABLE_CACHES or TORCHINDUCTOR_FX_GRAPH_CACHE=0); going on without it")
    try:
        path.mkdir(parents=True, exist_ok=True)
        # a probe file with a name of its own: ranks probing at once never touch each other's
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        return (f"warning: compile cache {path} cannot be written ({reason}); going on without it "
                f"(torch's default cache)")
    os.environ[CACHE_DIR_VARIABLE] = str(path)
    return None
