"""The hybrid model, one file per block; no parallelism and no quantization branches in here."""

from hybridtron.model.lm import HybridLM, LMOutput

__all__ = ["HybridLM", "LMOutput"]
