"""One process of tests/ops/test_compile_cache.py: point the compile cache at argv[1], compile a two-layer MLP's
forward and backward, and print one JSON line: the cache's warning (or null) and torch's cache counters."""

from __future__ import annotations

import json
import sys

import torch
from torch._dynamo.utils import counters

from hybridtron.ops.compile_cache import use_compile_cache


def main() -> None:
    warning = use_compile_cache(sys.argv[1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model)
    x = torch.randn(3, 8)
    loss = compiled(x).square().sum()
    loss.backward()
    eager = model(x).square().sum()
    print(json.dumps({"warning": warning, "loss_matches": bool(torch.allclose(loss, eager, rtol=1e-5, atol=1e-6)),
                      "inductor": dict(counters["inductor"]), "aot_autograd": dict(counters["aot_autograd"])}))


if __name__ == "__main__":
    main()
