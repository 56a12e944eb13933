"""Inference: the hybrid cache, sampling, generation, MTP speculative decoding, SSM state quantization, memory
accounting (`hybridtron memory`) and the OpenAI-compatible server (`hybridtron serve`)."""
