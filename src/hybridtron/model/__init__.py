"""The hybrid model, one file per block, each with its training forward and one static decode step; `state.py`
holds the recurrent state a forward continues from. No parallelism, quantization or decoding fast paths in here
(those live in dist/, numerics/ and infer/)."""

from hybridtron.model.lm import HybridLM, LMOutput

__all__ = ["HybridLM", "LMOutput"]
