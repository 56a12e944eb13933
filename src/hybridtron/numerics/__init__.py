"""Low-precision numerics: NVFP4 and MXFP8 formats, the Random Hadamard Transform, emulated quantized GEMMs.

The names below load from `linear.py` on first use, so that importing a light submodule (`numerics.policy`'s
command-line arguments, which `hybridtron precision --help` and `hybridtron plan` read) does not import torch.
"""

import importlib

__all__ = [
    "QuantLinear",
    "QuantRecipe",
    "QuantizedGroupedMM",
    "UnderflowStats",
    "emulated_linear",
    "quantized_grouped_mm",
    "set_underflow_tracking",
]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("hybridtron.numerics.linear"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
