"""The vLLM side of the vLLM rollout engine (hybridtron.post.rl.engines.vllm): a process started with the vLLM
environment's Python (`.venv-vllm/bin/python`, scripts/setup_vllm.sh) running this file as a script, so that it
imports vLLM and the standard library and nothing of hybridtron (whose environment pins newer transformers than
vLLM accepts). It connects back to the rollout role over `multiprocessing.connection` (the address and key in
HYBRIDTRON_VLLM_ADDRESS / HYBRIDTRON_VLLM_AUTHKEY), builds one `vllm.LLM` and answers requests, one at a time:

    ("weights", {"path", "version"})   reload_weights from a checkpoint directory the role wrote, then label the
                                       weights with the version (vLLM's own weight version)
    ("nccl_init", {...}) / ("nccl_update", {...})   the GPU path: vLLM's NCCL weight-transfer engine
    ("generate", {"prompts", "params", "seeds", "n", "version", "experts"})   samples with their token ids, the
                                       log-probs vLLM sampled them with, the finish reason and (GPU, MoE) the
                                       routed experts; every token's weight version checked against "version"
    ("score", {"sequences", "top_k"})   prompt log-probs of whole sequences (MOPD's teacher scoring)
    ("version", None)                  the weight version vLLM holds
    ("close", None)

Each answer is ("ok", result) or ("error", one line). The vLLM interfaces used (vllm 0.32, paths in site-packages):
`LLM.collective_rpc("reload_weights", kwargs={"weights_path": ...})` (v1/worker/gpu_worker.py `reload_weights`,
model_executor/model_loader/reload/inplace.py: the weights replaced in place), `LLMEngine.set_weight_version` /
`CompletionOutput.weight_versions` (v1/engine/core.py, outputs.py `WeightVersionSpan`: the version attached to
every sampled token), `logprobs_mode="processed_logprobs"` (config/model.py: log-probs after temperature and
top-k / top-p, the distribution the token was drawn from), `SamplingParams(prompt_logprobs=k)` (prompt tokens skip
the sampling processors: the model's plain log-softmax), `enable_return_routed_experts` (config/aux_output.py,
outputs.py `CompletionOutput.routed_experts`: [tokens, MoE layers, top-k]).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from multiprocessing.connection import Client

# run as a script, this file's directory comes first on sys.path, and it holds hybridtron's vllm.py: drop it, so that
# `import vllm` is vLLM
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:2000]


class Worker:
    def __init__(self, options: dict):
        from vllm import LLM
        from vllm.platforms import current_platform

        self.options = options
        kwargs = dict(model=options["model"], dtype=options["dtype"], seed=options["seed"],
                      max_model_len=options["max_model_len"], logprobs_mode="processed_logprobs",
                      max_logprobs=options["max_logprobs"], enforce_eager=options["enforce_eager"])
        if options.get("speculative"):
            kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": options["speculative"]}
        if options.get("routed_experts"):
            kwargs["enable_return_routed_experts"] = True
        if options.get("weight_transfer"):
            from vllm.config import WeightTransferConfig

            kwargs["weight_transfer_config"] = WeightTransferConfig(backend=options["weight_transfer"])
        if current_platform.is_cpu():
            # vLLM 0.32's CPU build fails on any prompt longer than one Mamba cache block with prefix caching on
            # (model_executor/layers/mamba/mamba_mixer2.py, conv_ssm_forward: `varlen_states[last_chunk_indices_p]`
            # raises IndexError; measured with 200-token prompts), so the CPU engine runs without it
            kwargs["enable_prefix_caching"] = False
            # and without chunked prefill: vLLM 0.32 splits a round's prefills over steps past max_num_batched_tokens
            # (4096: a GRPO step of 16 x 8 math prompts), then rewinds each split sample's seeded generator with
            # `Generator.set_offset` (v1/worker/gpu_model_runner.py, _bookkeeping_sync), which a CPU generator lacks:
            # "RuntimeError: CPU Generator does not use offset". Unsplit, a prefill waits for the next step instead
            kwargs["enable_chunked_prefill"] = False
        kwargs.update(options.get("engine_args") or {})
        self.llm = LLM(**kwargs)

    @property
    def version(self) -> str:
        return self.llm.llm_engine.get_weight_version()

    def weights(self, path: str, version: int) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        self.llm.llm_engine.set_weight_version(str(version))

    def nccl_init(self, init_info: dict) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    def nccl_update(self, update_info: dict, version: int) -> None:
        self.llm.collective_rpc("start_weight_update")
        self.llm.collective_rpc("update_weights", args=(update_info,))
        self.llm.collective_rpc("finish_weight_update")
        self.llm.llm_engine.set_weight_version(str(version))

    def generate(self, prompts, params: dict, seeds, n: int, version: int, experts: bool) -> list:
        from vllm import SamplingParams

        expected = str(version)
        if self.version != expected:
            raise ValueError(f"weight version: vLLM holds {self.version!r}, the rollout asked for {expected!r}")
        requests = [SamplingParams(n=n, seed=seed, logprobs=0, **params) for seed in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], requests, use_tqdm=False)
        result = []
        for output in outputs:
            samples = []
            for c in sorted(output.outputs, key=lambda c: c.index):
                versions = {span.version for span in c.weight_versions or ()}
                if versions - {expected}:
                    raise ValueError(f"weight version: tokens of a sample were drawn with {sorted(versions)}, the "
                                     f"rollout asked for {expected!r}")
                logprobs = [step[token].logprob for step, token in zip(c.logprobs, c.token_ids)]
                routed = c.routed_experts
                samples.append({"token_ids": list(c.token_ids), "logprobs": logprobs,
                                "finish_reason": c.finish_reason,
                                "routed_experts": None if routed is None or not experts else routed.tolist()})
            result.append(samples)
        return result

    def score(self, sequences, top_k: int) -> list:
        """Per sequence, for positions 1.. : (log p of the token there, the top_k ids, their log-probs)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=top_k, temperature=1.0)
        outputs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
        result = []
        for sequence, output in zip(sequences, outputs):
            rows = []
            for token, step in zip(sequence[1:], output.prompt_logprobs[1:]):
                ranked = sorted(((v.rank, i, v.logprob) for i, v in step.items() if v.rank <= top_k))[:top_k]
                rows.append((step[token].logprob, [i for _, i, _ in ranked], [lp for _, _, lp in ranked]))
            result.append(rows)
        return result


def main() -> None:
    address = json.loads(os.environ["HYBRIDTRON_VLLM_ADDRESS"])
    connection = Client(tuple(address) if isinstance(address, list) else address,
                        authkey=bytes.fromhex(os.environ["HYBRIDTRON_VLLM_AUTHKEY"]))
    options = connection.recv()
    try:
        import vllm
        from vllm.platforms import current_platform

        worker = Worker(options)
        connection.send(("ok", {"vllm": vllm.__version__, "device": current_platform.device_type}))
    except BaseException as exc:  # noqa: BLE001 (the role reports it in one line; the log has the traceback)
        traceback.print_exc()
        connection.send(("error", one_line(exc)))
        return
    while True:
        try:
            op, payload = connection.recv()
        except EOFError:  # the role went away
            return
        if op == "close":
            connection.send(("ok", None))
            return
        try:
            if op == "version":
                result = worker.version
            else:
                result = getattr(worker, op)(**payload)
            connection.send(("ok", result))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            connection.send(("error", one_line(exc)))


if __name__ == "__main__":
    sys.exit(main())
