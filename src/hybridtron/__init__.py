"""hybridtron: the Nemotron 3 Ultra recipe end to end, from the hybrid model to speculative decoding."""

from hybridtron.config import ModelConfig, preset

__all__ = ["ModelConfig", "preset"]
__version__ = "0.1.0"
