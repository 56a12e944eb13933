"""Low-precision numerics: NVFP4 and MXFP8 formats, the Random Hadamard Transform, emulated quantized GEMMs."""

from hybridtron.numerics.linear import (
    QuantizedGroupedMM,
    QuantLinear,
    QuantRecipe,
    UnderflowStats,
    emulated_linear,
    quantized_grouped_mm,
    set_underflow_tracking,
)

__all__ = [
    "QuantLinear",
    "QuantRecipe",
    "QuantizedGroupedMM",
    "UnderflowStats",
    "emulated_linear",
    "quantized_grouped_mm",
    "set_underflow_tracking",
]
