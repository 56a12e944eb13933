"""Checkpoints: the HF `nemotron_h` format for models (hf.py) and DCP for training state (dcp.py).

    from hybridtron.checkpoint import load_pretrained, save_pretrained
    save_pretrained(model, "ckpt")          # config.json + safetensors, NVIDIA's tensor names
    model = load_pretrained("ckpt")         # also reads checkpoints written by transformers
"""

from hybridtron.checkpoint.hf import load_pretrained, save_pretrained

__all__ = ["load_pretrained", "save_pretrained"]
