"""The teachers of multi-teacher on-policy distillation: which teacher scores which prompt, and the role that
scores the student's rollouts.

- `TeacherPanel`: a static map domain -> teacher checkpoint (`--teachers math=DIR,code=DIR`), with a general
  fallback (`--general DIR`: in Ultra's recipe the RLVR student itself) for a domain that has no teacher of its own.
  A domain with neither is an error, raised before anything trains (`check_domains`), never a silent skip.
- `TeacherScoringRole`: the pipeline stage between rollout and learning (hybridtron.post.rl.roles). For every
  rollout it runs the teacher of the rollout's domain over prompt + completion and stores the teacher's log-prob
  of each completion token in `Rollout.scores["teacher"]`, the log pi_T(y_t | s_t) of the MOPD advantage, and,
  for the top-K reverse KL (`top_k` > 0), the teacher's K most likely tokens at each position and their log-probs
  (`scores["teacher_topk_ids"]`, `scores["teacher_topk_logp"]`: [C, K]; 8 bytes x K a token, not the vocabulary). The
  teachers are frozen (eval mode, no gradients) and take no weights from the learner; rows are batched per
  teacher, sorted by length so that padding stays small (right padding: causal layers never see it).

The teachers must share the student's tokenizer (they are made from the same base: docs/post-training.md's teacher recipes,
the math_teacher and code_teacher stages of `hybridtron pipeline`): their log-probs are of the student's token ids.
The log-probs are taken at the rollouts' sampling temperature (1 by default), without the top-k / top-p filters:
a filtered teacher would give -inf to any token outside its nucleus. They are computed `logprob_chunk` rows at a time
through lm_head (`hybridtron.post.rl.objective.token_scores`), never as [tokens, vocab] logits.

- `teacher_answers`: a teacher's own answers to training tasks, the data of a warmup on the teacher's data (the
  mopd command's `mopd.warmup_data = "teacher"`, the pipeline's `[mopd_warmup] teacher_samples`); in a tool
  environment each answer is the teacher's whole trajectory through the environment's turn loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.data.chat import load_chat_tokenizer
from hybridtron.eval.tasks import evaluate_env
from hybridtron.infer.engine import HybridEngine
from hybridtron.infer.sampling import SamplingParams
from hybridtron.post.agentic import engine_generate, run_episodes
from hybridtron.post.rl.batches import rollout_rows
from hybridtron.post.rl.config import LOGPROB_CHUNK
from hybridtron.post.rl.engines.vllm import VLLMTeacher
from hybridtron.post.rl.objective import head_forward, token_scores
from hybridtron.post.rl.rollout import Rollout, ScoringRole, completion_scores


def teacher_answers(teacher_dir: str | Path, env, tasks, *, temperature: float, max_tokens: int, seed: int,
                    tries: int = 1, verified: bool = False, top_k: int = 0, top_p: float = 1.0,
                    enable_thinking: bool | None = None, batch_size: int = 64) -> list[dict]:
    """Conversations of `tasks` (`env`'s) whose assistant turn the teacher checkpoint `teacher_dir` wrote, sampled
    at `temperature`: its first try at each task or, `verified`, the first of its `tries` that `env` scores 1
    (rejection sampling), a task it never solves left out (a ValueError if it solves none). A completion cut at
    `max_tokens` stands as it is. In an environment with tools an answer is a trajectory (`teacher_trajectories`),
    its conversation carrying the tools (SFT renders them and trains on the assistant turns alone)."""
    tasks = list(tasks)
    if not tasks:
        return []
    teacher = load_pretrained(teacher_dir, dtype=torch.float32).eval()
    tokenizer = load_chat_tokenizer(teacher_dir, vocab_size=teacher.config.vocab_size)
    asked = tasks * (tries if verified else 1)
    if env.tools:
        samples = teacher_trajectories(teacher, tokenizer, env, asked, temperature=temperature, top_k=top_k,
                                       top_p=top_p, max_tokens=max_tokens, seed=seed, enable_thinking=enable_thinking,
                                       batch_size=batch_size)
    else:
        scored = evaluate_env(teacher, tokenizer, env, asked, max_tokens=max_tokens, batch_size=batch_size,
                              temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              enable_thinking=enable_thinking)
        samples = [({"messages": env.prompt_messages(task) + [{"role": "assistant", "content": completion}]}, reward)
                   for task, completion, reward in zip(asked, scored.completions, scored.rewards)]
    answers: dict[int, dict] = {}
    for index, (example, reward) in enumerate(samples):
        if not verified or reward == 1.0:
            answers.setdefault(index % len(tasks), example)
    if not answers:
        raise ValueError(f"the teacher {teacher_dir} solved none of {len(tasks)} {env.domain} training tasks in "
                         f"{tries} tries each")
    return [{**answers[i], "domain": env.domain} for i in sorted(answers)]


def teacher_trajectories(teacher, tokenizer, env, tasks, *, temperature: float, top_k: int, top_p: float,
                         max_tokens: int, seed: int, enable_thinking: bool | None,
                         batch_size: int) -> list[tuple[dict, float]]:
    """(conversation, reward) of each task of the tool environment `env`: the teacher's trajectory through its turn
    loop (`hybridtron.post.agentic.run_episodes`: each turn up to `max_tokens`, the whole within the teacher's
    context), `batch_size` at a time; the conversation's assistant turns are the teacher's text, its `tool`
    messages the real responses, and it carries `env.tools`."""
    generate = engine_generate(HybridEngine.from_model(teacher, tokenizer, speculative=False))
    samples = []
    for start in range(0, len(tasks), batch_size):
        # each batch its own noise: a task asked again in a later batch at the same place is another sample
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens,
                                seed=seed + start)
        for trajectory in run_episodes(generate, tokenizer, env, tasks[start:start + batch_size], params,
                                       token_budget=teacher.config.max_position_embeddings,
                                       enable_thinking=enable_thinking):
            messages = trajectory.conversation(env.prompt_messages(trajectory.task))
            samples.append(({"messages": messages, "tools": list(env.tools)}, trajectory.reward))
    return samples


TEACHER_SCORE = "teacher"  # the name of the teacher's per-token log-probs in Rollout.scores
TEACHER_TOPK_IDS, TEACHER_TOPK_LOGP = "teacher_topk_ids", "teacher_topk_logp"  # its top-K tokens [C, K] and log-probs
TEACHER_ROLE = "teachers"


@dataclass(frozen=True)
class TeacherPanel:
    """domain -> teacher checkpoint directory, and the fallback for other domains (None: no fallback)."""

    teachers: dict[str, str] = field(default_factory=dict)
    general: str | None = None

    @classmethod
    def parse(cls, text: str | None, general: str | None = None) -> "TeacherPanel":
        """`--teachers math=DIR,code=DIR` (and `--general DIR`), each directory checked to be a checkpoint."""
        teachers: dict[str, str] = {}
        for item in (text or "").split(","):
            item = item.strip()
            if not item:
                continue
            domain, sep, directory = item.partition("=")
            domain, directory = domain.strip(), directory.strip()
            if not sep or not domain or not directory:
                raise ValueError(f"--teachers: {item!r} is not DOMAIN=DIR; expected e.g. --teachers "
                                 "math=runs/math_teacher/hf,code=runs/code_teacher/hf")
            if domain in teachers:
                raise ValueError(f"--teachers: domain {domain!r} is given twice ({teachers[domain]} and {directory})")
            teachers[domain] = directory
        if not teachers and general is None:
            raise ValueError("--teachers is required: DOMAIN=DIR pairs, e.g. --teachers math=DIR,code=DIR (and/or "
                             "--general DIR, the fallback teacher)")
        panel = cls(teachers, general)
        for flag, directory in panel.flags():
            check_checkpoint(directory, flag)
        return panel

    def flags(self) -> list[tuple[str, str]]:
        """(the option naming it, directory) of every teacher, for messages."""
        pairs = [(f"--teachers {domain}=", directory) for domain, directory in self.teachers.items()]
        return pairs + ([("--general ", self.general)] if self.general is not None else [])

    def teacher_for(self, domain: str) -> str:
        if domain in self.teachers:
            return self.teachers[domain]
        if self.general is not None:
            return self.general
        raise ValueError(f"domain {domain!r} has no teacher: --teachers names {', '.join(self.teachers) or 'none'} "
                         f"and there is no --general fallback")

    def check_domains(self, domains: list[str]) -> None:
        """Every domain the prompts come from has a teacher, and every teacher a domain that will use it."""
        for domain in domains:
            self.teacher_for(domain)
        unused = [domain for domain in self.teachers if domain not in domains]
        if unused:
            raise ValueError(f"--teachers names the domain(s) {', '.join(unused)}, but no environment of mopd.envs "
                             f"has them (their domains: {', '.join(domains)}); add the environment or drop the teacher")

    def directories(self) -> list[str]:
        """The distinct checkpoints of the panel (a teacher serving two domains is loaded once)."""
        return list(dict.fromkeys([*self.teachers.values(), *([self.general] if self.general else [])]))


def check_checkpoint(directory: str, flag: str) -> None:
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"{flag}{directory}: no such checkpoint directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{flag}{directory}: not an HF checkpoint (no config.json)")


class TeacherScoringRole(ScoringRole):
    """Adds `scores["teacher"]` (and with `top_k` > 0 the teacher's top-K tokens) to every rollout of a batch (see
    the module docstring), each scored by the teacher of its domain. Built from plain values: the panel's `teachers`
    and `general`, the rollouts' `temperature`, `batch_size` rows per forward, `top_k`, and `logprob_chunk` rows per
    block of lm_head; `engine`: "hybridtron" (the teachers in this process) or "vllm" (each in a vLLM process, at
    temperature 1: hybridtron.post.rl.engines.vllm.VLLMTeacher), `section` naming the setting in its errors;
    `share`: see `hybridtron.post.rl.rollout.ScoringRole`."""

    name = TEACHER_ROLE
    seconds_key = "teacher_seconds"

    def __init__(self, *, teachers: dict[str, str], general: str | None, temperature: float = 1.0,
                 batch_size: int = 16, threads: int = 0, top_k: int = 0, logprob_chunk: int = LOGPROB_CHUNK,
                 engine: str = "hybridtron", section: str = "mopd", share=None):
        super().__init__(batch_size=batch_size, share=share)
        if threads:
            torch.set_num_threads(threads)
        self.panel = TeacherPanel(dict(teachers), general)
        self.temperature, self.top_k, self.logprob_chunk = temperature, top_k, logprob_chunk
        if engine == "vllm":  # each teacher a vLLM process (hybridtron.post.rl.engines.vllm.VLLMTeacher)
            self.models = {directory: VLLMTeacher(directory, section=section, top_k=top_k)
                           for directory in self.panel.directories()}
        else:
            self.models = {directory: load_pretrained(directory, dtype=torch.float32).eval().requires_grad_(False)
                           for directory in self.panel.directories()}

    def models_for(self, rollouts: list[Rollout]):
        by_teacher: dict[str, list[Rollout]] = {}
        for rollout in rollouts:
            by_teacher.setdefault(self.panel.teacher_for(rollout.domain), []).append(rollout)
        return [(self.models[directory], mine) for directory, mine in by_teacher.items()]

    def score(self, model, rollouts: list[Rollout]) -> None:
        """The teacher's log-prob of each completion token, into each rollout's scores (float32 [C]); with top_k, its
        top-K tokens at each completion position (int32 [C, K]) and their log-probs (float32 [C, K])."""
        if not isinstance(model, torch.nn.Module):  # a teacher on vLLM
            for rollout, (logp, top_ids, top_logp) in zip(rollouts, model.score(rollouts)):
                rollout.scores[TEACHER_SCORE] = logp
                if self.top_k:
                    rollout.scores[TEACHER_TOPK_IDS], rollout.scores[TEACHER_TOPK_LOGP] = top_ids, top_logp
            return
        rows = rollout_rows(rollouts, model.config.pad_token_id or 0)
        head, _ = head_forward(model, rows.input_ids, mtp=False)
        scored = token_scores(head, rows.labels, self.temperature, top=self.top_k, chunk=self.logprob_chunk)
        completion_scores(rollouts, TEACHER_SCORE, scored.logp)
        if self.top_k:
            completion_scores(rollouts, TEACHER_TOPK_IDS, scored.top_ids.to(torch.int32))
            completion_scores(rollouts, TEACHER_TOPK_LOGP, scored.top_logp)

    def close(self) -> None:
        for model in self.models.values():
            if not isinstance(model, torch.nn.Module):
                model.close()
