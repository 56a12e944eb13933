"""Peak memory of a GRPO learner step at Ultra's vocabulary: the log-probs by blocks of rows (`grpo.logprob_chunk`)
against the whole [tokens, vocab] logits, in one process.

    python bench/rl_logprob_memory.py [--tokens 1k,2k,4k,8k] [--paths blocks,logits,before] [--chunk 128]
                                      [--threads 2] [--json PATH]

The `tiny` preset with Ultra's vocabulary, 131,072 tokens (its width, 192, keeps lm_head's weight at 96 MiB), in
fp32; one micro-batch of `--tokens` positions, rows of 512 (a 32-token prompt and a 481-token completion: 481 of
every 512 positions scored), one forward and backward of `GRPOObjective` with [grpo]'s defaults (the MTP loss on,
weight 0.1, over the preset's 2 depths; the entropy logged; no routing replay: the memory does not depend on it).
The paths:

    blocks  lm_head applied by the loss, `--chunk` rows at a time (ops/linear_logprobs.py: no [tokens, vocab]
            tensor beyond one block), the MTP depths through pretraining's fused lm_head + CE
    logits  the model's logits and each MTP depth's, [tokens, vocab] each, handed to the same loss
            (`loss_from_outputs`, as a quantized lm_head's `HeadOutputs` hand them), the log-probs by
            blocks of `--chunk` rows of them
    before  the path before `logprob_chunk`, as GRPO's loss ran it (`loss_before`): `sampled_logprobs` on the
            whole logits, the entropy of them without a graph, the MTP depths' cross entropy on theirs

Each (tokens, path) runs in a process of its own (this script with `--worker`), so each peak is its own:

    peak  the growth of the process's peak resident memory (`ru_maxrss`) from before the model is built to after
          the backward: what the OS had to give the step, allocator overheads included (torch's CPU allocator keeps
          no count of its own; tracemalloc does not see its allocations).
    time  the forward and backward, wall clock.

A configuration the machine cannot hold is skipped, not crashed into: when the same path's last measured peak,
scaled by the tokens (both paths grow linearly with them), exceeds MemAvailable; and while it runs, its data limit
(RLIMIT_DATA, what was available) turns an allocation past it into an error instead of a call to the OOM killer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from hybridtron.config import tiny
from hybridtron.model.lm import HybridLM
from hybridtron.post.grpo import GRPOConfig, GRPOObjective
from hybridtron.post.losses import grpo_loss, token_entropy
from hybridtron.post.rl.batches import rollout_rows
from hybridtron.post.rl.config import LOGPROB_CHUNK
from hybridtron.post.rl.objective import HeadOutputs, sampled_logprobs
from hybridtron.post.rl.rollout import Rollout
from hybridtron.post.sft import sft_loss
from hybridtron.train.preflight import available_memory

from clock import cpu_model
from long_context_memory import GiB, HEADROOM, length_label, parse_length, peak_rss_bytes

VOCAB = 131072  # Ultra's (and Nano's, Super's)
ROW, PROMPT = 512, 32  # positions per row; prompt tokens of each
PATHS = ("blocks", "logits", "before")


def micro_batch(config, tokens: int, seed: int = 0):
    """`tokens` // ROW rollouts of random tokens (groups of 4, rewards 1, 0, 0, 1), as the learner gets them."""
    g = torch.Generator().manual_seed(seed)
    completion = ROW - PROMPT + 1
    rollouts = [Rollout(task_id=f"t{i // 4}", domain="bench", difficulty=1,
                        prompt_ids=torch.randint(3, config.vocab_size, (PROMPT,), generator=g).tolist(),
                        completion_ids=torch.randint(3, config.vocab_size, (completion,), generator=g).tolist(),
                        logprobs=-torch.rand(completion, generator=g) * 3, finish_reason="length",
                        reward=float(i % 4 in (0, 3)), advantage=0.866 if i % 4 in (0, 3) else -0.866)
                for i in range(tokens // ROW)]
    return rollout_rows(rollouts, config.pad_token_id or 0)


def loss_before(objective, model, mb) -> torch.Tensor:
    """GRPO's loss of `mb` as the learner computed it before `logprob_chunk` (what it kept in memory; the metrics
    left out): through the whole [tokens, vocab] logits of the model and of each MTP depth."""
    cfg, counts = objective.config, objective.counts  # counts: completion and policy tokens, sequences, MTP targets
    lm = model(mb.input_ids, mtp=objective.mtp_depths > 0, counted=mb.counted)
    logp = sampled_logprobs(lm.logits, mb.labels, cfg.temperature, cfg.top_k, cfg.top_p)
    with torch.no_grad():
        entropy = token_entropy(lm.logits.float() / cfg.temperature)
    loss, _ = grpo_loss(logp, logp.detach(), mb.advantages, mb.policy_mask, counts[1], objective.loss_config,
                        rollout_logp=mb.rollout_logprobs, entropy=entropy)
    mtp = [sft_loss(logits, mb.mtp_targets(depth), counts[2 + depth])
           for depth, logits in enumerate(lm.mtp_logits, start=1)]
    return loss + cfg.mtp_loss_weight * torch.stack(mtp).mean() if mtp else loss


def worker(tokens: int, path: str, chunk: int, threads: int) -> dict:
    """One configuration's learner step in this process: its peak growth and time."""
    torch.set_num_threads(threads)
    before = peak_rss_bytes()  # torch and hybridtron loaded, nothing built
    torch.manual_seed(0)
    config = tiny().replace(vocab_size=VOCAB)
    model = HybridLM(config)
    objective = GRPOObjective(GRPOConfig(logprob_chunk=chunk, routing_replay=False), config.mtp_depths)
    mb = micro_batch(config, tokens)
    objective.begin_step([mb])
    start = time.perf_counter()
    if path == "blocks":
        loss = objective(model, mb).loss
    elif path == "logits":
        lm = model(mb.input_ids, mtp=objective.mtp_depths > 0, counted=mb.counted)
        loss = objective.loss_from_outputs(model, HeadOutputs((lm.logits, *lm.mtp_logits)), mb).loss
    else:
        loss = loss_before(objective, model, mb)
    loss.backward()
    return {"tokens": tokens, "path": path, "peak_bytes": peak_rss_bytes() - before,
            "peak_rss_before_bytes": before, "time_s": time.perf_counter() - start,
            "loss": float(loss), "scored_tokens": int(mb.completion_mask.sum())}


def run_worker(args, tokens: int, path: str, limit: int) -> dict:
    """A configuration in its own process, its memory capped at `limit` bytes: its record, or why it has none."""
    command = [sys.executable, __file__, "--worker", str(tokens), path, "--limit", str(limit), "--chunk",
               str(args.chunk), "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    if "can't allocate memory" in done.stderr or "MemoryError" in done.stderr:
        return {"skipped": f"ran out of memory at its {limit / GiB:.1f} GiB limit (what was available)"}
    sys.exit(f"{length_label(tokens)} tokens, path {path} failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1k,2k,4k,8k", help="positions of the micro-batch (default 1k,2k,4k,8k)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"of {', '.join(PATHS)} (default all)")
    parser.add_argument("--chunk", type=int, default=LOGPROB_CHUNK, help=f"grpo.logprob_chunk (default "
                                                                         f"{LOGPROB_CHUNK})")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", nargs=2, metavar=("TOKENS", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=int, help=argparse.SUPPRESS)  # the worker's data limit, in bytes
    args = parser.parse_args()
    if args.worker:
        resource.setrlimit(resource.RLIMIT_DATA, (args.limit, args.limit))
        print(json.dumps(worker(int(args.worker[0]), args.worker[1], args.chunk, args.threads)))
        return
    token_counts = [parse_length(n) for n in args.tokens.split(",")]
    if bad := [n for n in token_counts if n < ROW or n % ROW]:
        parser.error(f"--tokens: {', '.join(map(str, bad))} is not a multiple of the rows' {ROW} positions")
    paths = [p.strip() for p in args.paths.split(",")]
    if unknown := sorted(set(paths) - set(PATHS)):
        parser.error(f"--paths: unknown path(s) {', '.join(unknown)}; choose from {', '.join(PATHS)}")
    header = (f"tiny with vocab {VOCAB} ({HybridLM(tiny().replace(vocab_size=VOCAB)).num_parameters() / 1e6:.1f}M "
              f"parameters), fp32, one GRPO learner forward + backward, rows of {ROW} positions "
              f"({ROW - PROMPT + 1} scored), grpo.logprob_chunk {args.chunk}, {args.threads} thread(s)")
    print(header)
    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores; {(available_memory(torch.device('cpu')) or 0) / GiB:.1f} "
          f"GiB available; torch {torch.__version__}; Python {platform.python_version()}\n")
    print("| tokens | path | peak (GiB) | peak / blocks | forward + backward (s) |")
    print("|---:|---|---:|---:|---:|")
    results = []
    for tokens in token_counts:
        for path in paths:  # a count's paths side by side: they see the same machine load
            available = (available_memory(torch.device("cpu")) or 0) - HEADROOM
            shorter = [r for r in results if r["path"] == path and "peak_bytes" in r]
            needed = shorter[-1]["peak_bytes"] * tokens / shorter[-1]["tokens"] if shorter else 0
            if needed > available:
                result = {"skipped": f"needs about {needed / GiB:.1f} GiB (linear in the tokens from "
                                     f"{length_label(shorter[-1]['tokens'])}), {available / GiB:.1f} GiB available"}
            else:
                result = run_worker(args, tokens, path, available)
            result.update(tokens=tokens, path=path)
            results.append(result)
            blocks = next((r for r in results if r["tokens"] == tokens and r["path"] == "blocks"
                           and "peak_bytes" in r), None)
            start = f"| {length_label(tokens)} | {path} |"
            if "skipped" in result:
                print(f"{start} skipped: {result['skipped']} | | |", flush=True)
            else:
                ratio = f"{result['peak_bytes'] / blocks['peak_bytes']:.1f}" if blocks else "-"
                print(f"{start} {result['peak_bytes'] / GiB:.2f} | {ratio} | {result['time_s']:.1f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": header, "cpu": cpu_model(), "torch": torch.__version__,
                                               "date": time.strftime("%Y-%m-%d"), "results": results}, indent=1))


if __name__ == "__main__":
    main()
