"""`hybridtron mopd`: multi-teacher on-policy distillation (MOPD), Nemotron 3 Ultra's stage after RLVR.

The student samples its own completions; the teacher of each prompt's domain scores every sampled token; the
student is trained on the per-token reverse KL to that teacher, with no environment reward:

    J = sum_i lambda_i E_{q ~ D_i, y ~ student} sum_t [log pi_Ti(y_t | s_t) - log pi_theta(y_t | s_t)]

One run:

0. Warmup (`mopd.warmup_steps` > 0; 0 is the ablation without it): a light SFT of the student on each domain's
   data, so that its samples start inside the teachers' support (the report: GDPVal 35.3 without, 46.7 with,
   teacher 49.5). The data: the environments' worked solutions (`mopd.warmup_data = "env"`, their `sft_examples`)
   or completions sampled from each domain's teacher ("teacher"), split by `mopd.domain_weights`. It is a
   `hybridtron sft` run in `out/warmup/` (its own checkpoints, metrics and HF export, resumed like any run); MOPD
   then starts from `out/warmup/hf`.
1. Rollouts (hybridtron.post.mixture): `prompts_per_step` prompts of `mopd.envs`, stratified by domain (lambda_i =
   `domain_weights`), ONE completion each (Ultra: one rollout per prompt was enough), from the inference engine
   with MTP speculative drafts and routing replay, as GRPO's rollout role samples them; the environments' rewards
   are logged per domain, never trained on.
2. Teacher scoring (hybridtron.post.teachers): the teacher panel (`--teachers DOMAIN=DIR,...`, `--general DIR`
   for the other domains; in the recipe the RLVR student) adds each token's log pi_T to the rollout.
3. Learning (`MOPDObjective`, the same `Trainer` as every stage): `hybridtron.post.losses.mopd_loss`, the
   asynchronous form: A_t = sg[log pi_T - log pi_prox], r_t = pi_theta / pi_prox clipped to [1 - 0.2, 1 + 0.28],
   c_t = pi_prox / pi_behav masked by IcePop in [0.2, 5] (or truncated: `mopd.correction = "tis"`), token-mean
   over the step's global count of completion tokens, as GRPO. One policy step per batch, as GRPO: pi_prox is the
   learner at the start of the step (r = 1, the clip inactive), and what pi_behav differs by is the engine's
   numerics and, asynchronously, one step of staleness. The MTP loss stays on (`mopd.mtp_loss_weight`).
   `mopd.kl_top_k` = K > 0 (not the report's) trains instead the reverse KL over the teacher's K most likely
   tokens at every position of the student's samples (`topk_reverse_kl`: K + 1 outcomes, the rest of the
   vocabulary one), a dense signal where the sampled estimate sees one token a position.

The three roles run on the `RolePipeline` of hybridtron.post.roles, with GRPO's learner end
(`hybridtron.post.rollout.RolloutBatches`): synchronous by default (`mopd.async_rollouts = false`: inline, batch
n + 1 sampled after step n's update); asynchronous with `mopd.staleness` = 1 (batch n + 1 sampled and scored while
step n trains, with the weights step n started from) on separate processes or Ray actors (`mopd.rollout_backend`
= process | ray; on a Ray cluster `mopd.rollout_ray_resource` / `mopd.teacher_ray_resource` name the custom
resource of the machine each actor must run on: see hybridtron.post.roles). The learner's weights go to the
rollout role before every request; the teachers are frozen.

Logged every step: loss, policy_loss, mtp_loss_<d>, reverse_kl (the sampled KL(student || teacher)) overall and
per domain (`reverse_kl/<domain>`: each domain against its own teacher), with kl_top_k topk_reverse_kl overall and
per domain, teacher_logp, student_logp, entropy, clip_fraction, is_mismatch, is_out_of_bounds_share, reward_mean
and response_length per domain, rollout tokens/s, MTP acceptance, policy_staleness; held-out greedy pass@1 per
domain (`pass_at_1/<domain>`, and their mean) at step 0, every `mopd.eval_every` steps and at the end.

The run directory (the rules of every training command: hybridtron.train.run):

    run_config.json   --student, --teachers, --general and the resolved [model], [mopd], [train], [monitor]
    warmup/           the warmup's SFT run (with warmup_steps > 0); warmup_data.jsonl, its conversations
    metrics.jsonl     one line per MOPD step (above); events.jsonl: the stability monitor's
    checkpoints/      DCP checkpoints (the rollout role's state and the batches sampled ahead included)
    hf/               the distilled student: config.json, safetensors, tokenizer files with the chat template

A run that finished says so and changes nothing; one that was killed (in the warmup or in MOPD) continues with
`--resume`, bit for bit.

This module's top-level imports stay light (the CLI builds its parser from it); torch loads when a run starts.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from hybridtron.config import ModelConfig
from hybridtron.dist.config import DistConfig
from hybridtron.post.grpo import THINKING, RolloutObjective
from hybridtron.post.roles import BACKENDS, check_replicas

if TYPE_CHECKING:  # imported with torch, when a run starts
    from hybridtron.train.config import TrainConfig
    from hybridtron.train.monitor.config import MonitorConfig

# [train] defaults of MOPD, GRPO's (a small constant LR after a short warmup, 4 micro-batches a step)
MOPD_TRAIN = dict(steps=100, lr=1e-4, warmup_steps=5, decay_fraction=0.0, grad_accum=4, checkpoint_every=20)
MODEL_FIXED = "the model is fixed by --student (its config.json); MOPD trains the weights, not the architecture"
WARMUP_DATA = ("env", "teacher", "verified")
WARMUP_DIR, WARMUP_FILE = "warmup", "warmup_data.jsonl"


@dataclass(frozen=True, kw_only=True)
class MOPDConfig:
    """The `[mopd]` section: prompts, rollouts, teachers, asynchrony, the loss, the warmup and the evaluation."""

    # prompts: each environment's domain picks its teacher
    envs: tuple[str, ...] = ("math", "code")  # environments (names, or module.path:Class) whose tasks are the prompts
    domain_weights: tuple[float, ...] = ()  # lambda_i: each environment's share of a step's prompts; empty = equal
    levels: tuple[int, ...] = ()  # difficulty levels of every environment; empty = each one's default
    env_levels: tuple[str, ...] = ()  # per environment, ENV=LEVELS over `levels`: e.g. math=1-2,code=1/3
    prompts_per_step: int = 16  # prompts per optimizer step, one rollout each (at least one per domain)
    task_pool: int = 2000  # training-split tasks drawn once, split by domain_weights; a step samples among them
    # rollouts
    temperature: float = 1.0  # sampling temperature (the learner's and the teachers' log-probs use the same)
    top_p: float = 1.0  # nucleus filter of the rollouts (1 = off)
    top_k: int = 0  # top-k filter of the rollouts (0 = off)
    max_new_tokens: int = 128  # completion length cap
    thinking: str = "auto"  # the generation prompt's thinking switch: auto, on, off
    routing_replay: bool = True  # R3: the rollout's experts forced in the learner's forward
    speculative: bool = True  # MTP speculative drafts in the rollouts
    draft_length: int = 3  # tokens drafted per verification step
    teacher_batch_size: int = 16  # rollouts per teacher forward
    # asynchrony (the three roles: rollout, teacher scoring, learning)
    async_rollouts: bool = False  # true: rollout and scoring in other processes, overlapping training
    staleness: int = 1  # async: batch n is sampled with the weights after step n - 1 - staleness (0 = synchronous)
    rollout_backend: str = "process"  # async: process (torch.multiprocessing) or ray (the rl extra); inline: tests
    rollout_threads: int = 1  # async: torch threads of each role process (0 = torch's default)
    rollout_replicas: int = 1  # async: rollout processes (or Ray actors), each generating a share of every step
    teacher_replicas: int = 1  # async: teacher-scoring processes (or actors), each scoring a share of the rollouts
    rollout_ray_resource: str = ""  # ray: a custom resource the rollout actor needs (places it on a machine); "" = any
    teacher_ray_resource: str = ""  # ray: the same for the teacher-scoring actor (e.g. "teachers")
    # the loss (hybridtron.post.losses.MOPDLossConfig)
    eps_clip: float = 0.2  # ratio clipped to [1 - eps_clip, 1 + eps_clip_high]
    eps_clip_high: float = 0.28
    correction: str = "icepop"  # behaviour-to-proximal weight c: icepop (mask), tis (truncate), none
    correction_level: str = "token"  # token, or sequence (the geometric mean over the completion)
    tis_low: float = 0.0  # TIS: clamp(c, tis_low, tis_high)
    tis_high: float = 2.0
    icepop_low: float = 0.2  # IcePop: tokens with c outside [icepop_low, icepop_high] dropped (NeMo-RL's Ultra MOPD)
    icepop_high: float = 5.0
    aggregation: str = "token_mean"  # token_mean, or sequence_mean
    kl_top_k: int = 0  # 0: the sampled reverse KL (the report's); K: the reverse KL over the teacher's top-K tokens
    mtp_loss_weight: float = 0.1  # MTP CE on the completions, so the drafter follows the student (0 = off)
    # warmup: a light SFT on each domain's data before MOPD (0 = the ablation without it)
    warmup_steps: int = 20  # SFT steps (the run's first phase, in out/warmup)
    warmup_data: str = "env"  # env: the environments' worked solutions; teacher: samples of each domain's teacher;
    # verified: the first of warmup_tries teacher samples the environment scores 1 (unsolved tasks left out)
    warmup_tries: int = 4
    warmup_examples: int = 1000  # conversations, split by domain_weights
    warmup_lr: float = 5e-4  # peak LR of the warmup (after a 10% linear warmup; the last 20% decays)
    warmup_batch_size: int = 8  # packed rows per micro-batch of the warmup
    warmup_grad_accum: int = 1  # micro-batches per warmup step (under dist.pp: at least one per pipeline stage)
    warmup_seq_len: int = 256  # tokens per packed row
    warmup_train_on_thinking: bool = True  # loss on the reasoning too: the student's samples include it
    # held-out evaluation: greedy pass@1 on each environment's test split
    eval_tasks: int = 100  # per domain; 0 = no evaluation
    eval_every: int = 10  # steps between evaluations (and at step 0 and the end)
    eval_max_tokens: int = 128  # completion length cap of the evaluation
    eval_batch_size: int = 64  # prompts decoded together
    seed: int = 0  # the task pool, the prompt draws, the sampling and the warmup data

    # What the rollout role (hybridtron.post.rollout.RolloutRole) reads of GRPO's settings, fixed for MOPD (class
    # attributes, not fields: not settable): one sample per prompt, no reward to filter or steer by.
    group_size = 1
    dynamic_sampling = False
    max_refill_rounds = 0
    curriculum = False
    curriculum_target, curriculum_sigma, curriculum_ema = 0.5, 0.2, 0.5
    advantage_mode, advantage_eps = "zscore", 1e-6

    @property
    def enable_thinking(self) -> bool | None:
        return THINKING[self.thinking]

    def loss_config(self):
        from hybridtron.post.losses import MOPDLossConfig

        try:
            return MOPDLossConfig(**{f.name: getattr(self, f.name) for f in fields(MOPDLossConfig)})
        except ValueError as exc:
            raise ValueError(f"mopd: {exc}") from None

    def level_map(self) -> dict[str, tuple[int, ...]]:
        """{environment: its difficulty levels}: `levels` for every one, then `env_levels` (ENV=A-B, ENV=A/B/C or
        ENV=A) for those it names."""
        levels = {env: self.levels for env in self.envs} if self.levels else {}
        for item in self.env_levels:
            env, sep, text = item.partition("=")
            try:
                if not sep or not env:
                    raise ValueError
                if "-" in text:
                    low, high = (int(x) for x in text.split("-"))
                    values = tuple(range(low, high + 1))
                else:
                    values = tuple(int(x) for x in text.split("/"))
                if not values:
                    raise ValueError
            except ValueError:
                raise ValueError(f"mopd.env_levels: {item!r} is not ENV=LEVELS (e.g. math=1-2 or code=1/3)") from None
            if env not in self.envs:
                raise ValueError(f"mopd.env_levels: {env!r} is not one of mopd.envs ({', '.join(self.envs)})")
            levels[env] = values
        return levels

    def mixture(self):
        """The prompts' environments as one (hybridtron.post.mixture.MixtureEnv)."""
        from hybridtron.post.mixture import MixtureEnv

        return MixtureEnv(self.envs, self.domain_weights, self.level_map())

    def sampling_params(self, seed: int):
        from hybridtron.infer.sampling import SamplingParams

        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed,
                              max_tokens=self.max_new_tokens)

    def validate(self) -> None:
        for name in ("prompts_per_step", "max_new_tokens", "draft_length", "teacher_batch_size", "eval_every",
                     "eval_max_tokens", "eval_batch_size", "warmup_examples", "warmup_tries", "warmup_batch_size",
                     "warmup_grad_accum", "warmup_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"mopd.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("staleness", "rollout_threads", "eval_tasks", "top_k", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"mopd.{name} must be >= 0, got {getattr(self, name)}")
        if not self.envs:
            raise ValueError("mopd.envs must name at least one environment")
        if self.prompts_per_step < len(self.envs):
            raise ValueError(f"mopd.prompts_per_step ({self.prompts_per_step}) must be at least the number of "
                             f"environments ({len(self.envs)}: {', '.join(self.envs)}): every domain in every step")
        if self.task_pool < self.prompts_per_step:
            raise ValueError(f"mopd.task_pool ({self.task_pool}) must be at least mopd.prompts_per_step "
                             f"({self.prompts_per_step})")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"mopd.temperature must be > 0 (the student samples), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"mopd.top_p must be in (0, 1], got {self.top_p}")
        for name, value, choices in (("thinking", self.thinking, THINKING), ("rollout_backend", self.rollout_backend,
                                     BACKENDS), ("warmup_data", self.warmup_data, WARMUP_DATA)):
            if value not in choices:
                raise ValueError(f"mopd.{name} must be one of {', '.join(choices)}, got {value!r}")
        check_replicas("mopd", {"rollout_replicas": self.rollout_replicas, "teacher_replicas": self.teacher_replicas},
                       async_rollouts=self.async_rollouts, backend=self.rollout_backend)
        if not (self.mtp_loss_weight >= 0 and math.isfinite(self.mtp_loss_weight)):
            raise ValueError(f"mopd.mtp_loss_weight must be >= 0, got {self.mtp_loss_weight}")
        if not self.warmup_lr > 0:
            raise ValueError(f"mopd.warmup_lr must be > 0, got {self.warmup_lr}")
        if any(level < 1 for levels in self.level_map().values() for level in levels):
            raise ValueError(f"mopd.levels / mopd.env_levels must be positive difficulty levels, got "
                             f"{self.level_map()}")
        self.loss_config()


@dataclass(frozen=True, kw_only=True)
class MOPDRunConfig:
    """What `hybridtron mopd` runs: the student and the teacher panel as given on the command line, and the
    sections."""

    student: str  # --student: an HF checkpoint directory with tokenizer files (the RLVR student)
    teachers: dict  # --teachers: domain -> teacher checkpoint directory
    general: str | None  # --general: the fallback teacher of every other domain (None: none)
    model: ModelConfig  # the student's config.json (read-only)
    mopd: MOPDConfig
    train: TrainConfig
    monitor: MonitorConfig
    dist: DistConfig = DistConfig()  # the learner's layout under torchrun (GRPO's rules: hybridtron.post.rollout)

    @property
    def panel(self):
        from hybridtron.post.teachers import TeacherPanel

        return TeacherPanel(dict(self.teachers), self.general)

    def sections(self) -> dict:
        return {"mopd": self.mopd, "train": self.train, "monitor": self.monitor, "dist": self.dist}

    def to_dict(self) -> dict:
        from hybridtron.train.config import _plain

        return {"student": self.student, "teachers": dict(self.teachers), "general": self.general,
                "model": self.model.to_hf(), **{name: _plain(section) for name, section in self.sections().items()}}

    def save(self, path: str | Path) -> None:
        from hybridtron.files import atomic_write_json

        atomic_write_json(path, self.to_dict())

    def command(self) -> str:
        teachers = ",".join(f"{domain}={directory}" for domain, directory in self.teachers.items())
        return (f"hybridtron mopd --student {self.student}" + (f" --teachers {teachers}" if teachers else "")
                + (f" --general {self.general}" if self.general else ""))

    def to_toml(self) -> str:
        """[mopd], [train], [monitor] and [dist] as TOML that `--config` reads back; [model] is the student's."""
        from hybridtron.train.run import sections_toml

        return (f"# {self.command()}\n# [model] is {self.student}/config.json, fixed by --student\n\n"
                + sections_toml(self.sections()))

    @classmethod
    def load(cls, path: str | Path) -> "MOPDRunConfig":
        from hybridtron.train.config import TrainConfig, _build, read_run_config
        from hybridtron.train.monitor.config import MonitorConfig

        raw = read_run_config(path, ("student", "teachers", "model", "mopd", "train"), "a MOPD run")
        return cls(student=raw["student"], teachers=dict(raw["teachers"]), general=raw.get("general"),
                   model=ModelConfig.from_hf(raw["model"]), mopd=_build(MOPDConfig, raw["mopd"], "mopd"),
                   train=_build(TrainConfig, raw["train"], "train"),
                   monitor=_build(MonitorConfig, raw.get("monitor", {}), "monitor"),
                   dist=_build(DistConfig, raw.get("dist", {}), "dist"))


def default_sections() -> dict:
    from hybridtron.train.config import TrainConfig
    from hybridtron.train.monitor.config import MonitorConfig

    return {"mopd": MOPDConfig(), "train": TrainConfig(**MOPD_TRAIN), "monitor": MonitorConfig(), "dist": DistConfig()}


def _same_dir(a: str | None, b: str | None) -> bool:
    return (a is None) == (b is None) and (a is None or Path(a).resolve() == Path(b).resolve())


def resolve_config(args) -> MOPDRunConfig:
    """defaults (or, with --resume, the run's saved config; or a run's run_config.json as --config) <- the TOML
    file <- --set overrides <- --steps. [model] is the student's and cannot be set."""
    from hybridtron.post.grpo import rollout_run_sections
    from hybridtron.post.teachers import TeacherPanel, check_checkpoint
    from hybridtron.train.run import saved_config_file

    toml_path, base = args.config, None
    if args.resume:
        base = MOPDRunConfig.load(saved_config_file(args))
        if args.student is not None and not _same_dir(args.student, base.student):
            raise ValueError(f"--resume: --student {args.student} is not the run's ({base.student}, in "
                             f"{args.out}/run_config.json); resume with the run's student, or start a new run")
        if args.teachers is not None or args.general is not None:
            given = TeacherPanel.parse(args.teachers, args.general)
            same = given.teachers.keys() == base.teachers.keys() and all(
                _same_dir(given.teachers[d], base.teachers[d]) for d in given.teachers) and \
                _same_dir(given.general, base.general)
            if not same:
                raise ValueError(f"--resume: the teacher panel differs from the run's ({base.command()}); resume "
                                 "with the run's teachers, or start a new run in another --out")
        student, panel = base.student, base.panel
    else:
        if not args.student:
            raise ValueError("--student is required (see hybridtron mopd --help)")
        student, panel = args.student, TeacherPanel.parse(args.teachers, args.general)
        if toml_path is not None and Path(toml_path).suffix == ".json":  # a run's own run_config.json
            if not Path(toml_path).is_file():
                raise FileNotFoundError(f"{toml_path}: config file not found")
            base, toml_path = MOPDRunConfig.load(toml_path), None
    check_checkpoint(student, "--student ")
    model = ModelConfig.from_hf(student)
    if args.resume and model != base.model:
        raise ValueError(f"--resume: {student}/config.json changed since the run started; the run trains the "
                         f"student it began with (see {args.out}/run_config.json)")
    sections = rollout_run_sections(base.sections() if base is not None else default_sections(), toml_path, args,
                                    MODEL_FIXED, "MOPD")
    return MOPDRunConfig(student=student, teachers=dict(panel.teachers), general=panel.general, model=model,
                         **sections)


# ---------------------------------------------------------------------------------------------- the loss
class MOPDObjective(RolloutObjective):
    """The MOPD loss of a micro-batch of scored rollouts (`hybridtron.post.rollout.RolloutMicroBatch` with
    `scores["teacher"]`), as a `Trainer` objective; see the module docstring.

    `domains`: those the prompts come from (each gets its `reverse_kl/<domain>`); `mtp_depths`: the model's;
    `parallel` (a sharded learner): see RolloutObjective.

    Metrics, each the step's value: loss, policy_loss, mtp_loss_<d>; over the completion tokens: reverse_kl (mean
    of log pi_student - log pi_teacher on the student's samples), reverse_kl/<domain>, teacher_logp,
    student_logp, entropy, clip_fraction, ratio_mean (or, with kl_top_k, topk_reverse_kl and its per-domain
    topk_reverse_kl/<domain>), is_mismatch, is_out_of_bounds_share; completion_tokens; and the rollout statistics of
    the batch."""

    headline = ("reverse_kl", "rkl")

    def __init__(self, config: MOPDConfig, domains: list[str], mtp_depths: int, *, parallel=None):
        super().__init__(config, mtp_depths, parallel)
        self.domains = list(domains)

    def row_counts(self, mb) -> list:
        """completion tokens, completion sequences, each domain's completion tokens"""
        mask = mb.completion_mask
        per_row = mask.sum(dim=1)
        return [mask.sum(), mask.any(dim=1).sum()] + [per_row[self._rows_of(mb, d)].sum() for d in self.domains]

    @staticmethod
    def _rows_of(mb, domain: str):
        import torch

        return torch.tensor([d == domain for d in mb.domains], dtype=torch.bool, device=mb.labels.device)

    def loss_from_outputs(self, model, outputs, mb, expert_counts=None):
        """The MOPD loss and metrics of a micro-batch from the student's (logits, *MTP logits) (`__call__` runs the
        forward first; a pipeline's last stage calls it, and its expert counts are then the pipeline's)."""
        import torch

        from hybridtron.post.grpo import sampled_logprobs
        from hybridtron.post.losses import masked_mean, mopd_loss, token_entropy, topk_reverse_kl
        from hybridtron.post.sft import sft_loss
        from hybridtron.post.teachers import TEACHER_SCORE, TEACHER_TOPK_IDS, TEACHER_TOPK_LOGP
        from hybridtron.train.objectives import ObjectiveOutput

        cfg, loss_cfg = self.config, self.loss_config
        if TEACHER_SCORE not in mb.scores:
            raise ValueError("MOPD micro-batch without teacher log-probs: the teacher-scoring role did not run")
        if loss_cfg.kl_top_k and TEACHER_TOPK_IDS not in mb.scores:
            raise ValueError(f"mopd.kl_top_k={loss_cfg.kl_top_k}, but the teacher-scoring role sent no top-K tokens "
                             "(it was built with top_k=0)")
        logits, *mtp_logits = outputs
        logp = sampled_logprobs(logits, mb.labels, cfg.temperature, cfg.top_k, cfg.top_p)
        mask, teacher = mb.completion_mask, mb.scores[TEACHER_SCORE]
        total_tokens, total_sequences = self.counts[0], self.counts[1]
        divisor = total_sequences if loss_cfg.aggregation == "sequence_mean" else total_tokens
        topk_kl = None
        if loss_cfg.kl_top_k:
            scaled = logits.float() / cfg.temperature
            student_topk = scaled.gather(-1, mb.scores[TEACHER_TOPK_IDS].long()) - scaled.logsumexp(-1, keepdim=True)
            topk_kl = topk_reverse_kl(student_topk, mb.scores[TEACHER_TOPK_LOGP])
        # one policy step per batch: the proximal policy is the learner before this step's update, i.e. now
        policy_loss, policy_metrics = mopd_loss(logp, logp.detach(), teacher, mask, divisor, loss_cfg,
                                                behav_logp=mb.rollout_logprobs, topk_kl=topk_kl)
        loss = policy_loss
        depth_counts = self.counts[2 + len(self.domains):]
        mtp_losses = [sft_loss(depth_logits, mb.mtp_targets(depth), depth_counts[depth - 1])
                      for depth, depth_logits in enumerate(mtp_logits[:self.mtp_depths], start=1)]
        if mtp_losses:
            loss = loss + cfg.mtp_loss_weight * torch.stack(mtp_losses).mean()
        with torch.no_grad():
            entropy = token_entropy(logits.float() / cfg.temperature)
        # the trainer logs the mean over micro-batches: each share scaled by their number
        scale, share = self.micro_batches, float(mask.sum()) / total_tokens
        per_token = {"teacher_logp": teacher, "student_logp": logp.detach(), "entropy": entropy}
        metrics = {"loss": loss.detach() * scale, "policy_loss": policy_loss.detach() * scale,
                   **{f"mtp_loss_{d}": m.detach() * scale for d, m in enumerate(mtp_losses, start=1)},
                   **{key: value.float() * share * scale for key, value in policy_metrics.items()},
                   **{key: masked_mean(value, mask) * share * scale for key, value in per_token.items()},
                   "completion_tokens": torch.tensor(total_tokens / self.data_ranks, dtype=torch.float32)}
        per_domain = {"reverse_kl": logp.detach() - teacher.float()}
        if topk_kl is not None:
            per_domain["topk_reverse_kl"] = topk_kl.detach()
        for index, domain in enumerate(self.domains):
            domain_mask = mask & self._rows_of(mb, domain).unsqueeze(1)
            domain_tokens = self.counts[2 + index]
            for key, per_token in per_domain.items():
                value = torch.where(domain_mask, per_token, 0.0).sum() / domain_tokens if domain_tokens else \
                    torch.zeros(())
                metrics[f"{key}/{domain}"] = value * scale
        metrics.update({key: torch.tensor(float(value) / self.data_ranks) for key, value in mb.stats.items()})
        return ObjectiveOutput(loss, metrics, int(mb.valid.sum()), expert_counts or {})


# --------------------------------------------------------------------------------------------- evaluation
class DomainAccuracy:
    """An evaluator: greedy pass@1 of the student on fixed test-split tasks of each domain (GRPO's
    `HeldOutAccuracy` per member of the mixture), as `pass_at_1/<domain>`, and their mean as `pass_at_1`."""

    key = "pass_at_1"

    def __init__(self, mixture, tokenizer, config: MOPDConfig):
        from hybridtron.post.grpo import HeldOutAccuracy, PolicySnapshot

        self.every = config.eval_every
        self.by_domain = {env.domain: HeldOutAccuracy(env, env.tasks("test", config.eval_tasks, config.seed),
                                                      tokenizer, config.eval_every, max_tokens=config.eval_max_tokens,
                                                      batch_size=config.eval_batch_size,
                                                      enable_thinking=config.enable_thinking)
                          for env in mixture.members}
        self.history: list[tuple[int, float]] = []
        self.snapshot = PolicySnapshot()

    def due(self, step: int, total_steps: int) -> bool:
        return step % self.every == 0 or step == total_steps

    def measure(self, model) -> dict[str, float]:
        values = {}
        for domain, evaluator in self.by_domain.items():
            result = evaluator.measure(model)
            values[f"pass_at_1/{domain}"] = result["pass_at_1"]
            values[f"eval_mean_reward/{domain}"] = result["eval_mean_reward"]
            values[f"eval_response_length/{domain}"] = result["eval_response_length"]
        return {self.key: sum(values[f"pass_at_1/{d}"] for d in self.by_domain) / len(self.by_domain), **values}

    def evaluate(self, trainer) -> dict[str, float]:
        from hybridtron.post.grpo import evaluate_on_main

        values = evaluate_on_main(trainer, self.snapshot, self.measure)
        for domain, evaluator in self.by_domain.items():
            evaluator.history.append((trainer.step, values[f"pass_at_1/{domain}"]))
        self.history.append((trainer.step, values[self.key]))
        return values

    def state_dict(self):
        return {"history": list(self.history), "domains": {d: e.state_dict() for d, e in self.by_domain.items()}}

    def load_state_dict(self, state):
        self.history = [tuple(x) for x in state["history"]]
        for domain, evaluator in self.by_domain.items():
            evaluator.load_state_dict(state["domains"][domain])


# ------------------------------------------------------------------------------------------------ warmup
def warmup_examples(config: MOPDRunConfig) -> list[dict]:
    """The warmup's conversations: each domain's share of `mopd.warmup_examples`, the environment's worked
    solutions ("env"), or completions of each training prompt sampled from the domain's teacher at the rollouts'
    temperature and length cap: its first ("teacher"; a completion cut at the cap is kept as it stands), or the
    first of `mopd.warmup_tries` that the environment scores 1 ("verified"; a prompt never solved is left out)."""
    from hybridtron.post.mixture import domain_quotas
    from hybridtron.post.teachers import teacher_answers

    mopd = config.mopd
    with mopd.mixture() as mixture:
        if mopd.warmup_data == "env":
            return mixture.sft_examples(mopd.warmup_examples, mopd.seed)
        examples = []
        for env, quota in zip(mixture.members, domain_quotas(mopd.warmup_examples, mixture.weights)):
            try:
                examples += teacher_answers(config.panel.teacher_for(env.domain), env,
                                            env.tasks("train", quota, mopd.seed), temperature=mopd.temperature,
                                            top_k=mopd.top_k, top_p=mopd.top_p, max_tokens=mopd.max_new_tokens,
                                            seed=mopd.seed, enable_thinking=mopd.enable_thinking,
                                            batch_size=mopd.eval_batch_size, tries=mopd.warmup_tries,
                                            verified=mopd.warmup_data == "verified")
            except ValueError as exc:
                raise ValueError(f"mopd.warmup_data={mopd.warmup_data}: {exc}, so the warmup has no {env.domain} "
                                 f"data; raise mopd.warmup_tries, or use warmup_data=teacher or env") from None
        return examples


def warmup_run_config(config: MOPDRunConfig, data_file: Path):
    """The warmup as a `hybridtron sft` run of the student on `data_file`."""
    from hybridtron.post.sft import SFT_TRAIN, SFTConfig, SFTRunConfig
    from hybridtron.train.config import TrainConfig

    mopd, train = config.mopd, config.train
    steps = mopd.warmup_steps
    sft_train = TrainConfig(**{**SFT_TRAIN, "steps": steps, "lr": mopd.warmup_lr, "warmup_steps": max(1, steps // 10),
                               "val_every": steps, "checkpoint_every": max(1, min(train.checkpoint_every, steps)),
                               "seed": train.seed, "threads": train.threads, "precision": train.precision,
                               "grad_accum": mopd.warmup_grad_accum})
    sft = SFTConfig(train_on_thinking=mopd.warmup_train_on_thinking, seq_len=mopd.warmup_seq_len,
                    batch_size=mopd.warmup_batch_size, val_batches=2, seed=mopd.seed)
    return SFTRunConfig(base_model=config.student, data=str(data_file), model=config.model, sft=sft,
                        train=sft_train, monitor=config.monitor, dist=config.dist)


def run_warmup(config: MOPDRunConfig, out: Path, *, resume: bool, quiet: bool) -> Path:
    """Phase 0 (see the module docstring): the warmup SFT in `out/warmup`, resumed or skipped when complete.
    Returns the warmed-up student's HF directory."""
    from hybridtron.data.chat import load_chat_tokenizer
    from hybridtron.post import sft
    from hybridtron.post.envs import write_jsonl
    from hybridtron.train.run import export_model, train_in_run_dir

    directory = out / WARMUP_DIR
    data_file = out / WARMUP_FILE
    tokenizer = load_chat_tokenizer(config.student, vocab_size=config.model.vocab_size)
    if not data_file.is_file():  # written once: a resumed warmup reads the same conversations
        # under torchrun every rank makes the same file and renames its own copy into place
        staging = data_file.with_suffix(f".tmp{os.environ.get('RANK', '0')}")
        write_jsonl(staging, warmup_examples(config)).replace(data_file)
    sft_config = warmup_run_config(config, data_file)
    args = argparse.Namespace(out=str(directory), resume=resume, steps=None)
    result = train_in_run_dir(args, sft_config, sft.SFTRunConfig.load,
                              lambda run_out, checkpoints: sft.build_trainer(sft_config, run_out, checkpoints,
                                                                             quiet=quiet))
    if result is not None:
        trainer, tokenizer = result
        # under torchrun: gathered, written by global rank 0, whole on every rank's return
        if export_model(trainer, directory / "hf", tokenizer, config.model.max_position_embeddings):
            history = trainer.evaluators[0].history if trainer.evaluators else []
            if history:
                print(f"warmup: validation loss {history[0][1]:.3f} -> {history[-1][1]:.3f}", file=sys.stderr)
    return directory / "hf"


# ------------------------------------------------------------------------------------------------- the run
def role_specs(config: MOPDRunConfig, student_dir: str | Path, backend: str, share=None) -> list:
    """The rollout and teacher-scoring roles of the pipeline (the learner is the trainer itself); `share`: this
    rank's part of their work when every torchrun rank runs them inline (`roles.WorkShare`)."""
    from hybridtron.post.mixture import MixtureRolloutRole
    from hybridtron.post.roles import RoleSpec
    from hybridtron.post.teachers import TeacherScoringRole

    mopd = config.mopd
    threads = mopd.rollout_threads if backend != "inline" else 0

    def placement(resource: str) -> dict:  # Ray actor options: the actor runs where `ray start --resources` has it
        return {"resources": {resource: 1}} if resource else {}

    return [RoleSpec(MixtureRolloutRole, dict(model_dir=str(student_dir), model_config=config.model, envs=mopd.envs,
                                              weights=mopd.domain_weights, levels=mopd.level_map(), config=mopd,
                                              threads=threads, share=share),
                     resources=placement(mopd.rollout_ray_resource), replicas=mopd.rollout_replicas),
            RoleSpec(TeacherScoringRole, dict(teachers=dict(config.teachers), general=config.general,
                                              temperature=mopd.temperature, batch_size=mopd.teacher_batch_size,
                                              threads=threads, top_k=mopd.kl_top_k, share=share),
                     resources=placement(mopd.teacher_ray_resource), replicas=mopd.teacher_replicas)]


def micro_batch_shape(config: MOPDRunConfig) -> tuple[int, int]:
    """(rows, positions) of a micro-batch at most: one rollout a prompt over grad_accum micro-batches, each a prompt
    (128 tokens budgeted) plus its completion."""
    rows = -(-config.mopd.prompts_per_step // config.train.grad_accum)
    return rows, min(config.model.max_position_embeddings, 128 + config.mopd.max_new_tokens)


def build_trainer(config: MOPDRunConfig, student_dir: str | Path, out: Path, checkpoints, *, quiet: bool,
                  stream=None):
    """The MOPD run of `config` in `out`, from the student in `student_dir` (--student, or the warmup's export):
    the role pipeline, the objective, the per-domain evaluation, the trainer. Returns (trainer, RunParts)."""
    import torch

    from hybridtron.checkpoint import load_pretrained
    from hybridtron.data.chat import load_chat_tokenizer
    from hybridtron.post.grpo import RunParts
    from hybridtron.post.roles import WorkShare
    from hybridtron.post.rollout import RolloutBatches, learner_layout, rollout_pipeline_factory
    from hybridtron.train.run import assemble_trainer, prepare_process, start_parallel

    stream = sys.stderr if stream is None else stream
    train, mopd, model_config = config.train, config.mopd, config.model
    rows, seq_len = micro_batch_shape(config)
    # under torchrun: every rank trains on its rows; the rollout and teacher roles split their work over the ranks
    # (inline roles) or run on rank 0 (roles in processes or Ray actors): RolloutBatches
    parallel = start_parallel(config.dist, model_config, **learner_layout(
        config.dist, model_config, mopd, rows=rows, seq_len=seq_len, grad_accum=config.train.grad_accum,
        what="MOPD"))
    quiet = quiet or (parallel is not None and not parallel.is_main)
    tokenizer = load_chat_tokenizer(student_dir, vocab_size=model_config.vocab_size)
    prepare_process(train, model_config, rows * seq_len, stream)
    model = load_pretrained(student_dir, config=model_config, dtype=torch.float32)
    staleness = mopd.staleness if mopd.async_rollouts else 0
    backend = mopd.rollout_backend if mopd.async_rollouts else "inline"
    shared = parallel is not None and backend == "inline"
    specs = role_specs(config, student_dir, backend, WorkShare() if shared else None)
    rollouts = RolloutBatches(rollout_pipeline_factory(specs, backend, staleness), staleness=staleness,
                              grad_accum=train.grad_accum, pad_id=model_config.pad_token_id or 0, parallel=parallel,
                              shared=shared)
    mixture = mopd.mixture()
    evaluators = [DomainAccuracy(mixture, tokenizer, mopd)] if mopd.eval_tasks else []
    objective = MOPDObjective(mopd, mixture.domains, model_config.mtp_depths, parallel=parallel)
    trainer = assemble_trainer(model, objective, rollouts, evaluators, train=train, monitor_config=config.monitor,
                               out=out, checkpoints=checkpoints, quiet=quiet, stream=stream, parallel=parallel)
    return trainer, RunParts(tokenizer, rollouts, mixture)


def check_inputs(config: MOPDRunConfig) -> None:
    """Before anything is written: the student has a chat tokenizer; every teacher has the student's vocabulary
    and tokenizer; the environments build, with distinct domains, each with a teacher."""
    from hybridtron.data.chat import load_chat_tokenizer

    from hybridtron.post.rollout import learner_layout

    rows, seq_len = micro_batch_shape(config)
    learner_layout(config.dist, config.model, config.mopd, rows=rows, seq_len=seq_len,
                   grad_accum=config.train.grad_accum, what="MOPD")
    mopd = config.mopd
    if mopd.warmup_steps:  # the warmup SFT runs on the same layout
        from hybridtron.post.sft import check_layout

        try:
            check_layout(warmup_run_config(config, Path(WARMUP_FILE)))
        except ValueError as exc:
            raise ValueError(f"the warmup (mopd.warmup_batch_size={mopd.warmup_batch_size}, mopd.warmup_grad_accum="
                             f"{mopd.warmup_grad_accum}, mopd.warmup_seq_len={mopd.warmup_seq_len}): {exc}") from None
    student = Path(config.student)
    load_chat_tokenizer(student, vocab_size=config.model.vocab_size, require_template=True)
    panel = config.panel
    for flag, directory in panel.flags():
        teacher = ModelConfig.from_hf(directory)
        if teacher.vocab_size != config.model.vocab_size:
            raise ValueError(f"{flag}{directory}: a vocabulary of {teacher.vocab_size} tokens, the student's has "
                             f"{config.model.vocab_size}; teachers must share the student's tokenizer")
        ours, theirs = student / "tokenizer.json", Path(directory) / "tokenizer.json"
        if not theirs.is_file() or theirs.read_bytes() != ours.read_bytes():
            raise ValueError(f"{flag}{directory}: its tokenizer.json is {'missing' if not theirs.is_file() else 'not'}"
                             f" the student's ({ours}); teachers must share the student's tokenizer (make them "
                             "from the same base)")
    try:
        with mopd.mixture() as mixture:
            domains = mixture.domains
    except ValueError as exc:
        raise ValueError(f"mopd.envs={list(mopd.envs)}: {exc}") from None
    panel.check_domains(domains)
    if mopd.max_new_tokens + 2 > config.model.max_position_embeddings:
        raise ValueError(f"mopd.max_new_tokens={mopd.max_new_tokens} leaves no room for a prompt in the model's "
                         f"{config.model.max_position_embeddings} positions")


def _has_checkpoints(directory: Path) -> bool:
    return directory.is_dir() and any(p.is_dir() and not p.name.count(".") for p in directory.glob("step_*"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hybridtron.train.run import add_run_arguments

    parser.add_argument("--student", help="the student: an HF checkpoint directory with its tokenizer files and chat "
                                          "template (the RLVR student, e.g. runs/grpo/hf; required unless --resume)")
    parser.add_argument("--teachers", help="the teacher of each domain, DOMAIN=DIR pairs separated by commas, e.g. "
                                           "math=runs/math_teacher/hf,code=runs/code_teacher/hf (the domains are "
                                           "the environments' of mopd.envs; required unless --general gives "
                                           "every domain's teacher, or --resume)")
    parser.add_argument("--general", help="the fallback teacher of every domain --teachers does not name (in the "
                                          "recipe the RLVR student itself; default: none, every domain needs one)")
    add_run_arguments(parser, sections="[mopd], [train], [monitor] and [dist]", default_steps=MOPD_TRAIN["steps"],
                      set_example="--set mopd.warmup_steps=0 --set mopd.async_rollouts=true",
                      config_default="MOPD's defaults", quiet_help="no progress bar")


def run(args) -> int:
    """The command (also what `hybridtron pipeline` calls, with an argparse Namespace of the options above)."""
    from hybridtron.checkpoint.dcp import CheckpointManager
    from hybridtron.train.run import (RUN_CONFIG, finish_run, finished_run, is_main_process, pass_at_1_line,
                                      train_in_run_dir)

    config = resolve_config(args)
    if args.print_config:
        print(config.to_toml(), end="")
        return 0
    if not args.out:
        raise ValueError("--out is required: the run directory to create (e.g. --out runs/mopd)")
    check_inputs(config)
    out = Path(args.out)
    checkpoints = CheckpointManager(out / "checkpoints", keep=config.train.keep_checkpoints)
    try:
        complete = finished_run(out, config, checkpoints, MOPDRunConfig.load)
    finally:
        checkpoints.close()
    if not complete:
        started = [d for d in (out / "checkpoints", out / WARMUP_DIR / "checkpoints") if _has_checkpoints(d)]
        if started and not args.resume:
            raise ValueError(f"{out}: holds an unfinished run (checkpoints in {started[0]}); pass --resume to "
                             "continue it, or choose another --out for a new run")
        out.mkdir(parents=True, exist_ok=True)
        if is_main_process():
            config.save(out / RUN_CONFIG)  # before the warmup: a run killed in it resumes from this file
    student_dir = Path(config.student)
    if config.mopd.warmup_steps > 0 and not complete:
        student_dir = run_warmup(config, out, resume=_has_checkpoints(out / WARMUP_DIR / "checkpoints"),
                                 quiet=args.quiet)
    elif config.mopd.warmup_steps > 0:
        student_dir = out / WARMUP_DIR / "hf"
    built: list = []  # the run's RunParts (hybridtron.post.grpo), closed at the end

    def build(run_out, run_checkpoints):
        trainer, parts = build_trainer(config, student_dir, run_out, run_checkpoints, quiet=args.quiet)
        built.append(parts)
        return trainer, parts

    # the MOPD phase resumes when it has checkpoints (a run killed in its warmup has none yet)
    phase_args = argparse.Namespace(**{**vars(args), "resume": _has_checkpoints(out / "checkpoints")})
    try:
        result = train_in_run_dir(phase_args, config, MOPDRunConfig.load, build)
    finally:
        for parts in built:
            parts.close()
    if result is None:  # the run in --out was already complete
        return 0
    trainer, parts = result
    finish_run(trainer, out, parts.tokenizer, config.model.max_position_embeddings,
               lambda history: pass_at_1_line(history, "held-out pass@1 (mean over domains)"))
    return 0
