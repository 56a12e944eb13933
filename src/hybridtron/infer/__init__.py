"""Inference: the serving cache, decoding fast paths and static steps, sampling, plain and MTP speculative decoding
in slots, the continuous-batching loop, the engine (request handles for the server, batched completions with
log-probs and expert ids for rollouts), SSM state quantization, memory accounting (`hybridtron memory`),
`hybridtron generate` and the OpenAI-compatible server (`hybridtron serve`).

Imports run one way: state_quant < cache < fastpath < steps < decoder < speculative < text < scheduler < engine <
generate, server (sampling beside them all, below decoder; memory on its own, below speculative).
"""
