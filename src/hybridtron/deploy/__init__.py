"""From a trained checkpoint to a deployed one.

    slice.py      `hybridtron slice`: an N-layer slice of a checkpoint (or a preset's config alone) for smoke tests
    quantize.py   `hybridtron quantize`: post-training NVFP4 / FP8 quantization written in ModelOpt's unified format
    modelopt_format.py  the format: quantized tensors and scales, hf_quant_config.json, quantization_config
"""
