"""Every stage's model measured the same way (`[eval]`): greedy pass@1 on held-out (test-split) math tasks and the
code pass rate (the mean share of hidden unit tests passed) with pass@1 on held-out code tasks
(`hybridtron.eval.tasks`); greedy pass@1 on held-out terminal tasks, each a trajectory through the turn loop with
the sandboxed bash tool (`hybridtron.post.rl.evaluation.HeldOutAccuracy`, as GRPO and MOPD measure a tool
environment; the agentic teacher's domain); the validation loss, the masked next-token CE of the assistant turns
(reasoning included) of held-out math and code conversations (`hybridtron.eval.conversations`); and the MTP
acceptance length of greedy self-speculative decoding on the evaluation prompts
(`hybridtron.post.mtp_boost.training.acceptance_length`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.data.chat import load_chat_tokenizer, tokenize_chat
from hybridtron.envs import get_env
from hybridtron.eval.conversations import held_out_loss
from hybridtron.eval.tasks import evaluate_env
from hybridtron.post.mtp_boost.training import acceptance_length
from hybridtron.post.rl.evaluation import HeldOutAccuracy
from hybridtron.recipe.config import PipelineConfig
from hybridtron.recipe.stage import AGENTIC_DOMAIN, CODE_DOMAIN, MATH_DOMAIN, domain_share


@dataclass
class EvalSet:
    """The held-out material every stage is measured on, drawn once."""

    math_tasks: list
    code_tasks: list
    agentic_tasks: list
    val_conversations: dict[str, list[dict]]  # by domain


def eval_set(config: PipelineConfig) -> EvalSet:
    ev, pipe = config.eval, config.pipeline
    val: dict[str, list[dict]] = {}
    tasks = {}
    for domain, n in ((MATH_DOMAIN, ev.math_tasks), (CODE_DOMAIN, ev.code_tasks)):
        with get_env(domain, levels=tuple(pipe.levels)) as env:
            # the validation conversations are held-out tasks too (the graded ones first), with their references
            drawn = env.tasks("test", max(n, domain_share(ev.val_conversations, domain)), ev.seed)
            tasks[domain] = drawn[:n]
            for task in drawn[:domain_share(ev.val_conversations, domain)]:
                val.setdefault(domain, []).append(
                    {"messages": env.prompt_messages(task) + [{"role": "assistant", "content": task.reference}]})
    with get_env(AGENTIC_DOMAIN, levels=tuple(pipe.levels)) as env:
        agentic = env.tasks("test", ev.agentic_tasks, ev.seed)
    return EvalSet(tasks[MATH_DOMAIN], tasks[CODE_DOMAIN], agentic, val)


def evaluate_model(hf_dir: Path, config: PipelineConfig, material: EvalSet) -> dict:
    """One stage's model measured (see the module docstring): math, code, terminal, validation loss, acceptance
    length."""
    ev, pipe = config.eval, config.pipeline
    if pipe.threads:
        torch.set_num_threads(pipe.threads)
    started = time.perf_counter()
    model = load_pretrained(hf_dir, dtype=torch.float32).eval()
    tokenizer = load_chat_tokenizer(hf_dir, vocab_size=model.config.vocab_size)
    result: dict[str, Any] = {}
    prompts = []
    for domain, tasks, max_tokens in ((MATH_DOMAIN, material.math_tasks, ev.max_tokens),
                                      (CODE_DOMAIN, material.code_tasks, ev.code_max_tokens)):
        with get_env(domain, levels=tuple(pipe.levels)) as env:
            scored = evaluate_env(model, tokenizer, env, tasks, max_tokens=max_tokens, batch_size=ev.batch_size)
            prompts += [tokenize_chat(tokenizer, env.prompt_messages(t), add_generation_prompt=True).ids.tolist()
                        for t in tasks[:domain_share(ev.acceptance_prompts, domain)]]
        result[f"{domain}_pass_at_1"] = scored.pass_at_1
        result[f"{domain}_mean_reward"] = scored.mean_reward
        result[f"{domain}_by_level"] = {str(k): v for k, v in scored.by_difficulty.items()}
        result[f"{domain}_completion_tokens"] = scored.mean_completion_tokens
        result[f"{domain}_truncated_share"] = scored.truncated_share
    result["code_pass_rate"] = result["code_mean_reward"]  # the share of hidden unit tests passed
    with get_env(AGENTIC_DOMAIN, levels=tuple(pipe.levels)) as env:
        scored = HeldOutAccuracy(env, material.agentic_tasks, tokenizer, 0, max_tokens=ev.agentic_max_tokens,
                                 batch_size=ev.batch_size, enable_thinking=None).measure(model)
    result[f"{AGENTIC_DOMAIN}_pass_at_1"] = scored["pass_at_1"]
    result[f"{AGENTIC_DOMAIN}_completion_tokens"] = scored["eval_response_length"]
    losses = held_out_loss(model, tokenizer, material.val_conversations)
    for domain in material.val_conversations:
        result[f"{domain}_val_loss"] = losses[domain]
    result["val_loss"] = losses["all"]  # token-weighted over both domains
    with torch.no_grad():
        result["acceptance_length"] = acceptance_length(model, prompts, ev.draft_length, ev.acceptance_tokens)
    result["seconds"] = time.perf_counter() - started
    return result


def format_row(e: dict) -> str:
    return (f"math pass@1 {e['math_pass_at_1']:.1%}, code pass rate {e['code_pass_rate']:.1%} (pass@1 "
            f"{e['code_pass_at_1']:.1%}), {AGENTIC_DOMAIN} pass@1 {e[f'{AGENTIC_DOMAIN}_pass_at_1']:.1%}, val loss "
            f"{e['val_loss']:.3f} (math {e['math_val_loss']:.3f}, code "
            f"{e['code_val_loss']:.3f}), MTP acceptance {e['acceptance_length']:.2f} (eval {e['seconds']:.0f}s)")
