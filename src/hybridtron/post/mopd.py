"""`hybridtron mopd`: multi-teacher on-policy distillation (MOPD), Nemotron 3 Ultra's stage after RLVR.

The student samples its own completions; the teacher of each prompt's domain scores every sampled token; the
student is trained on the per-token reverse KL to that teacher, with no environment reward:

    J = sum_i lambda_i E_{q ~ D_i, y ~ student} sum_t [log pi_Ti(y_t | s_t) - log pi_theta(y_t | s_t)]

One run:

0. Warmup (`mopd.warmup_steps` > 0; 0 is the ablation without it): a light SFT of the student on each domain's
   data, so that its samples start inside the teachers' support (hybridtron.post.mopd_warmup: the environments'
   worked solutions, `mopd.warmup_data = "env"`, or each domain's teacher's answers, "teacher" or "verified",
   split by `mopd.domain_weights`). It is a `hybridtron sft` run in `out/warmup/` (its own checkpoints, metrics and
   HF export, resumed like any run); MOPD then starts from `out/warmup/hf`.
1. Rollouts (hybridtron.post.mixture): `prompts_per_step` prompts of `mopd.envs`, stratified by domain (lambda_i =
   `domain_weights`), ONE completion each (Ultra: one rollout per prompt was enough), from the inference engine
   with MTP speculative drafts and routing replay, as GRPO's rollout role samples them; the environments' rewards
   are logged per domain, never trained on.
2. Teacher scoring (hybridtron.post.teachers): the teacher panel (`--teachers DOMAIN=DIR,...`, `--general DIR`
   for the other domains; in the recipe the RLVR student) adds each token's log pi_T to the rollout.
3. Learning (`MOPDObjective`, the same `Trainer` as every stage): `hybridtron.post.losses.mopd_loss`, the
   asynchronous form: A_t = sg[log pi_T - log pi_prox], r_t = pi_theta / pi_prox clipped to [1 - 0.2, 1 + 0.28],
   c_t = pi_prox / pi_behav masked by IcePop in [0.2, 5] (or truncated: `mopd.correction = "tis"`), token-mean
   over the step's global count of completion tokens, as GRPO. One policy step per batch by default, as GRPO:
   pi_prox is the learner at the start of the step (r = 1, the clip inactive), and what pi_behav differs by is the
   engine's numerics and, asynchronously, one step of staleness; with `mopd.global_batch` / `mopd.epochs` (the RL
   core's mini-batches, as GRPO's) pi_prox is the learner before the rollout batch's first update, fixed over its
   steps. The MTP loss stays on (`mopd.mtp_loss_weight`).
   `mopd.kl_top_k` = K > 0 (not the report's) trains instead the reverse KL over the teacher's K most likely
   tokens at every position of the student's samples (`topk_reverse_kl`: K + 1 outcomes, the rest of the
   vocabulary one), a dense signal where the sampled estimate sees one token a position. The student's log-probs
   (with kl_top_k those of the teacher's K tokens too), like the teachers', come `mopd.logprob_chunk` rows at a
   time through lm_head, never as [tokens, vocab] logits (hybridtron.post.rl.objective).

The three roles run on the `RolePipeline` of hybridtron.post.rl.roles, with the RL core's learner end
(`hybridtron.post.rl.batches.RolloutBatches`): synchronous by default (`mopd.async_rollouts = false`: inline, batch
n + 1 sampled after step n's update); asynchronous with `mopd.staleness` = 1 (batch n + 1 sampled and scored while
step n trains, with the weights step n started from) on separate processes or Ray actors (`mopd.rollout_backend`
= process | ray; on a Ray cluster `mopd.rollout_ray_resource` / `mopd.teacher_ray_resource` name the custom
resource of the machine each actor must run on: see hybridtron.post.rl.roles). The learner's weights go to the
rollout role after every rollout batch (every optimizer step, unless `mopd.global_batch` / `mopd.epochs` train a
batch over several); the teachers are frozen.

Logged every step: loss, policy_loss, mtp_loss_<d>, reverse_kl (the sampled KL(student || teacher)) overall and
per domain (`reverse_kl/<domain>`: each domain against its own teacher), with kl_top_k topk_reverse_kl overall and
per domain, teacher_logp, student_logp, entropy, clip_fraction (_low, _high), ratio_min / _max, approx_kl,
is_mismatch, is_out_of_bounds_share, reward_mean and response_length per domain, rollout tokens/s, MTP acceptance,
policy_staleness; held-out greedy pass@1 per domain (`pass_at_1/<domain>`, and their mean) at step 0, every
`mopd.eval_every` steps and at the end.

The run directory (the run scaffold's rules: hybridtron.train.run):

    run_config.json   --student, --teachers, --general and the resolved [model], [mopd], [train], [monitor]
    warmup/           the warmup's SFT run (with warmup_steps > 0); warmup_data.jsonl, its conversations
    metrics.jsonl     one line per MOPD step (above); events.jsonl: the stability monitor's
    checkpoints/      DCP checkpoints (the rollout role's state and the batches sampled ahead included)
    hf/               the distilled student: config.json, safetensors, tokenizer files with the chat template

A run that finished says so and changes nothing; one that was killed (in the warmup or in MOPD) continues with
`--resume`, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

import torch

from hybridtron.config import ModelConfig
from hybridtron.distributed.config import DistConfig
from hybridtron.post.losses import MOPDLossConfig, masked_mean, masked_range, mopd_loss, topk_reverse_kl
from hybridtron.post.mixture import MixtureEnv, MixtureRolloutRole, domain_quotas
from hybridtron.post.mopd_warmup import WARMUP_DATA, warmup_conversations, write_once
from hybridtron.post.rl.command import RolloutRunCommand
from hybridtron.post.rl.config import RESUMABLE_ROLLOUT_FIELDS, RolloutConfig
from hybridtron.post.rl.engines.base import ENGINES
from hybridtron.post.rl.engines.vllm import check_vllm_teacher
from hybridtron.post.rl.evaluation import DomainAccuracy
from hybridtron.post.rl.objective import RolloutObjective, as_head_outputs
from hybridtron.post.rl.roles import RoleSpec
from hybridtron.post.sft import COMMAND as SFT_COMMAND
from hybridtron.post.sft import SFT_TRAIN, SFTConfig, SFTRunConfig
from hybridtron.post.sft import check_layout as check_sft_layout
from hybridtron.post.teachers import (TEACHER_SCORE, TEACHER_TOPK_IDS, TEACHER_TOPK_LOGP, TeacherPanel,
                                      TeacherScoringRole)
from hybridtron.train.config import SectionedConfig, TrainConfig
from hybridtron.train.monitor.config import MonitorConfig
from hybridtron.train.run import Input, Phase

# [train] defaults of MOPD, GRPO's (a small constant LR after a short warmup, 4 micro-batches a step)
MOPD_TRAIN = dict(steps=100, lr=1e-4, warmup_steps=5, decay_fraction=0.0, grad_accum=4, checkpoint_every=20)
WARMUP_DIR, WARMUP_FILE = "warmup", "warmup_data.jsonl"


@dataclass(frozen=True, kw_only=True)
class MOPDConfig(RolloutConfig):
    """The `[mopd]` section: the shared rollout settings (hybridtron.post.rl.config), the domains and their teachers'
    scoring, MOPD's loss settings and the warmup."""

    SECTION = "mopd"
    RESUMABLE = (*RESUMABLE_ROLLOUT_FIELDS, "teacher_batch_size", "teacher_replicas", "teacher_engine")

    # prompts: each environment's domain picks its teacher
    envs: tuple[str, ...] = ("math", "code")  # environments (names, or module.path:Class) whose tasks are the prompts
    domain_weights: tuple[float, ...] = ()  # lambda_i: each environment's share of a step's prompts; empty = equal
    env_levels: tuple[str, ...] = ()  # per environment, ENV=LEVELS over `levels`: e.g. math=1-2,code=1/3
    prompts_per_step: int = 16  # prompts per rollout batch, one rollout each (at least one per domain)
    # teacher scoring
    teacher_batch_size: int = 16  # rollouts per teacher forward
    teacher_engine: str = "hybridtron"  # what scores: hybridtron (in the role) or vllm (a process a teacher; T = 1)
    teacher_replicas: int = 1  # async: teacher-scoring processes (or actors), each scoring a share of the rollouts
    rollout_ray_resource: str = ""  # ray: a custom resource the rollout actor needs (places it on a machine); "" = any
    teacher_ray_resource: str = ""  # ray: the same for the teacher-scoring actor (e.g. "teachers")
    # MOPD's own loss settings (hybridtron.post.losses.MOPDLossConfig): the behaviour-to-proximal weight c
    correction: str = "icepop"  # icepop (mask), tis (truncate), none
    icepop_low: float = 0.2  # IcePop: tokens with c outside [icepop_low, icepop_high] dropped (NeMo-RL's Ultra MOPD)
    icepop_high: float = 5.0
    kl_top_k: int = 0  # 0: the sampled reverse KL (the report's); K: the reverse KL over the teacher's top-K tokens
    # warmup: a light SFT on each domain's data before MOPD (0 = the ablation without it; post/mopd_warmup.py)
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
    eval_tasks: int = 100  # per domain; 0 = no evaluation

    # What the rollout role (hybridtron.post.rl.rollout.RolloutRole) reads of GRPO's settings, fixed for MOPD:
    # one sample per prompt, no reward to filter or steer by
    group_size: ClassVar[int] = 1
    dynamic_sampling: ClassVar[bool] = False
    max_refill_rounds: ClassVar[int] = 0
    curriculum: ClassVar[bool] = False
    curriculum_target: ClassVar[float] = 0.5
    curriculum_sigma: ClassVar[float] = 0.2
    curriculum_ema: ClassVar[float] = 0.5
    advantage_mode: ClassVar[str] = "zscore"
    advantage_eps: ClassVar[float] = 1e-6

    def loss_config(self) -> MOPDLossConfig:
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

    def mixture(self) -> MixtureEnv:
        """The prompts' environments as one."""
        return MixtureEnv(self.envs, self.domain_weights, self.level_map())

    def replica_counts(self) -> dict[str, int]:
        return {**super().replica_counts(), "teacher_replicas": self.teacher_replicas}

    def validate(self) -> None:
        super().validate()
        for name in ("teacher_batch_size", "warmup_examples", "warmup_tries", "warmup_batch_size",
                     "warmup_grad_accum", "warmup_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"mopd.{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"mopd.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not self.envs:
            raise ValueError("mopd.envs must name at least one environment")
        if self.domain_weights and len(self.domain_weights) != len(self.envs):  # before the run, not at its rollouts
            raise ValueError(f"mopd.domain_weights has {len(self.domain_weights)} weights for {len(self.envs)} "
                             f"environments ({', '.join(self.envs)}); give one per environment, or none for equal "
                             "shares")
        if self.prompts_per_step < len(self.envs):
            raise ValueError(f"mopd.prompts_per_step ({self.prompts_per_step}) must be at least the number of "
                             f"environments ({len(self.envs)}: {', '.join(self.envs)}): every domain in every step")
        if self.teacher_engine not in ENGINES:
            raise ValueError(f"mopd.teacher_engine must be one of {', '.join(ENGINES)}, got {self.teacher_engine!r}")
        if self.warmup_data not in WARMUP_DATA:
            raise ValueError(f"mopd.warmup_data must be one of {', '.join(WARMUP_DATA)}, got {self.warmup_data!r}")
        if not self.warmup_lr > 0:
            raise ValueError(f"mopd.warmup_lr must be > 0, got {self.warmup_lr}")
        if any(level < 1 for levels in self.level_map().values() for level in levels):
            raise ValueError(f"mopd.levels / mopd.env_levels must be positive difficulty levels, got "
                             f"{self.level_map()}")


@dataclass(frozen=True, kw_only=True)
class MOPDRunConfig(SectionedConfig):
    """What `hybridtron mopd` runs: the student and the teacher panel as given on the command line, and the
    sections."""

    MODEL_FROM = "student"

    student: str  # --student: an HF checkpoint directory with tokenizer files (the RLVR student)
    teachers: dict  # --teachers: domain -> teacher checkpoint directory
    general: str | None = None  # --general: the fallback teacher of every other domain (None: none)
    model: ModelConfig  # the student's config.json (read-only)
    mopd: MOPDConfig = MOPDConfig()
    train: TrainConfig = TrainConfig(**MOPD_TRAIN)
    monitor: MonitorConfig = MonitorConfig()
    dist: DistConfig = DistConfig()  # the learner's layout under torchrun (the RL core's rules)

    @property
    def panel(self) -> TeacherPanel:
        return TeacherPanel(dict(self.teachers), self.general)

    def command_line(self) -> str:
        teachers = ",".join(f"{domain}={directory}" for domain, directory in self.teachers.items())
        return (f"hybridtron mopd --student {self.student}" + (f" --teachers {teachers}" if teachers else "")
                + (f" --general {self.general}" if self.general else ""))


# ---------------------------------------------------------------------------------------------- the loss
class MOPDObjective(RolloutObjective):
    """The MOPD loss of a micro-batch of scored rollouts (`hybridtron.post.rl.batches.RolloutMicroBatch` with
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
        return torch.tensor([d == domain for d in mb.domains], dtype=torch.bool, device=mb.labels.device)

    def loss_from_outputs(self, model, outputs, mb, expert_counts=None):
        """The MOPD loss and metrics of a micro-batch from the student's outputs (`__call__` runs the forward
        first; a pipeline's last stage calls it with lm_head's inputs, `as_head_outputs`, and its expert counts are
        then the pipeline's)."""
        loss_cfg = self.loss_config
        if TEACHER_SCORE not in mb.scores:
            raise ValueError("MOPD micro-batch without teacher log-probs: the teacher-scoring role did not run")
        if loss_cfg.kl_top_k and TEACHER_TOPK_IDS not in mb.scores:
            raise ValueError(f"mopd.kl_top_k={loss_cfg.kl_top_k}, but the teacher-scoring role sent no top-K tokens "
                             "(it was built with top_k=0)")
        # the student's log-probs of the teacher's top K (with kl_top_k): the full-vocabulary ones, unfiltered
        head = as_head_outputs(model, outputs)
        scored = self.scores(head, mb, entropy=True,
                             given_ids=mb.scores[TEACHER_TOPK_IDS] if loss_cfg.kl_top_k else None)
        logp = scored.logp
        mask, teacher = mb.completion_mask, mb.scores[TEACHER_SCORE]
        total_tokens, total_sequences = self.counts[0], self.counts[1]
        divisor = total_sequences if loss_cfg.aggregation == "sequence_mean" else total_tokens
        topk_kl = None
        if loss_cfg.kl_top_k:
            topk_kl = topk_reverse_kl(scored.given_logp, mb.scores[TEACHER_TOPK_LOGP])
        # the proximal policy: the learner before the rollout batch's first update (fixed over its mini-batches),
        # or with one step a batch the learner before this step's update, i.e. now
        prox = logp.detach() if mb.old_logprobs is None else mb.old_logprobs
        policy_loss, policy_metrics = mopd_loss(logp, prox, teacher, mask, divisor, loss_cfg,
                                                behav_logp=mb.rollout_logprobs, topk_kl=topk_kl)
        ranges = {"ratio": policy_metrics.pop("ratio_range")} if "ratio_range" in policy_metrics else {}
        ranges["is_weight"] = masked_range((prox - mb.rollout_logprobs).exp(), mask)  # c's extremes: is_weight_max
        entropy = scored.entropy.detach()
        # the trainer logs the mean over micro-batches: each share scaled by their number
        scale, share = self.micro_batches, float(mask.sum()) / total_tokens
        per_token = {"teacher_logp": teacher, "student_logp": logp.detach(), "entropy": entropy}
        metrics = {**{key: value.float() * share * scale for key, value in policy_metrics.items()},
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
        return self.objective_output(head, mb, policy_loss, metrics, ranges, self.counts[2 + len(self.domains):],
                                     expert_counts)


# ------------------------------------------------------------------------------------------------ warmup
def warmup_run_config(config: MOPDRunConfig, data_file: Path) -> SFTRunConfig:
    """The warmup as a `hybridtron sft` run of the student on `data_file`."""
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


def warmup_phase_config(config: MOPDRunConfig, out: Path) -> SFTRunConfig | None:
    """Phase 0 (see the module docstring) as the run scaffold's `Phase`: the warmup SFT's configuration, its data
    (the teachers' answers) written once into `out` first; None without a warmup (`mopd.warmup_steps` 0)."""
    mopd = config.mopd
    if mopd.warmup_steps <= 0:
        return None

    def conversations() -> list[dict]:
        with mopd.mixture() as mixture:
            draws = list(zip(mixture.members, domain_quotas(mopd.warmup_examples, mixture.weights)))
            return warmup_conversations(draws, mopd.warmup_data, teacher_for=config.panel.teacher_for, seed=mopd.seed,
                                        temperature=mopd.temperature, max_tokens=lambda _: mopd.max_new_tokens,
                                        tries=mopd.warmup_tries, top_k=mopd.top_k, top_p=mopd.top_p,
                                        enable_thinking=mopd.enable_thinking, batch_size=mopd.eval_batch_size,
                                        setting=f"mopd.warmup_data={mopd.warmup_data}")

    return warmup_run_config(config, write_once(out / WARMUP_FILE, conversations))


# ------------------------------------------------------------------------------------------------ the command
class MOPD(RolloutRunCommand):
    name = "mopd"
    config_class = MOPDRunConfig
    section = "mopd"
    summary_what = "held-out pass@1 (mean over domains)"
    default_steps = MOPD_TRAIN["steps"]
    phases = (Phase(WARMUP_DIR, SFT_COMMAND, warmup_phase_config),)  # the warmup SFT, in out/warmup
    set_example = "--set mopd.warmup_steps=0 --set mopd.async_rollouts=true"
    inputs = (Input("--student", "student", "the student: an HF checkpoint directory with its tokenizer files and "
                                            "chat template, or a run directory (its hf/ export; the RLVR "
                                            "student, e.g. runs/grpo)", checkpoint=True),
              Input("--teachers", "teachers", "the teacher of each domain, DOMAIN=DIR pairs separated by commas, "
                                              "e.g. math=runs/math_teacher/hf,code=runs/code_teacher/hf (the domains "
                                              "are the environments' of mopd.envs; required unless --general gives "
                                              "every domain's teacher, or --resume)", optional=True),
              Input("--general", "general", "the fallback teacher of every domain --teachers does not name (in the "
                                            "recipe the RLVR student itself; default: none, every domain needs one)",
                    optional=True))

    def given_inputs(self, args):
        given = {**super().given_inputs(args), "teachers": None}  # --student resolved as every --model is
        if args.teachers is not None or args.general is not None:
            panel = TeacherPanel.parse(args.teachers, args.general)
            given["teachers"], given["general"] = dict(panel.teachers), panel.general
        return given

    def same_input(self, flag, given, saved):
        if isinstance(given, dict):
            return given.keys() == saved.keys() and all(super(MOPD, self).same_input(flag, given[d], saved[d])
                                                        for d in given)
        return super().same_input(flag, given, saved)

    def default_config(self, args, inputs):
        if inputs["teachers"] is None:  # neither --teachers nor --general: the panel's parser says what is needed
            TeacherPanel.parse(None, None)
        return MOPDRunConfig(model=ModelConfig.from_hf(inputs["student"]), **inputs)

    def policy_dir(self, config, out):
        return out / WARMUP_DIR / "hf" if config.mopd.warmup_steps > 0 else Path(config.student)

    def check_inputs(self, config):
        """The warmup's layout, the teachers' vocabulary and tokenizer (the student's), the environments' domains
        (distinct, each with a teacher)."""
        mopd = config.mopd
        if mopd.warmup_steps:  # the warmup SFT runs on the same layout
            try:
                check_sft_layout(warmup_run_config(config, Path(WARMUP_FILE)))
            except ValueError as exc:
                raise ValueError(f"the warmup (mopd.warmup_batch_size={mopd.warmup_batch_size}, "
                                 f"mopd.warmup_grad_accum={mopd.warmup_grad_accum}, mopd.warmup_seq_len="
                                 f"{mopd.warmup_seq_len}): {exc}") from None
        student = Path(config.student)
        panel = config.panel
        for flag, directory in panel.flags():
            teacher = ModelConfig.from_hf(directory)
            if teacher.vocab_size != config.model.vocab_size:
                raise ValueError(f"{flag}{directory}: a vocabulary of {teacher.vocab_size} tokens, the student's has "
                                 f"{config.model.vocab_size}; teachers must share the student's tokenizer")
            ours, theirs = student / "tokenizer.json", Path(directory) / "tokenizer.json"
            if not theirs.is_file() or theirs.read_bytes() != ours.read_bytes():
                raise ValueError(f"{flag}{directory}: its tokenizer.json is "
                                 f"{'missing' if not theirs.is_file() else 'not'} the student's ({ours}); teachers "
                                 "must share the student's tokenizer (make them from the same base)")
            if mopd.teacher_engine == "vllm":
                check_vllm_teacher("mopd", mopd.temperature, teacher, directory)
        try:
            with mopd.mixture() as mixture:
                domains = mixture.domains
        except ValueError as exc:
            raise ValueError(f"mopd.envs={list(mopd.envs)}: {exc}") from None
        panel.check_domains(domains)

    def role_specs(self, config, policy_dir, backend, share):
        mopd = config.mopd
        threads = mopd.rollout_threads if backend != "inline" else 0

        def placement(resource: str) -> dict:  # Ray actor options: the actor runs where `ray start --resources` has it
            return {"resources": {resource: 1}} if resource else {}

        return [RoleSpec(MixtureRolloutRole, dict(model_dir=str(policy_dir), model_config=config.model,
                                                  envs=mopd.envs, weights=mopd.domain_weights,
                                                  levels=mopd.level_map(), config=mopd, threads=threads, share=share),
                         resources=placement(mopd.rollout_ray_resource), replicas=mopd.rollout_replicas),
                RoleSpec(TeacherScoringRole, dict(teachers=dict(config.teachers), general=config.general,
                                                  temperature=mopd.temperature, batch_size=mopd.teacher_batch_size,
                                                  threads=threads, top_k=mopd.kl_top_k,
                                                  logprob_chunk=mopd.logprob_chunk, engine=mopd.teacher_engine,
                                                  share=share),
                         resources=placement(mopd.teacher_ray_resource), replicas=mopd.teacher_replicas)]

    def objective(self, config, parallel):
        with config.mopd.mixture() as mixture:
            domains = mixture.domains
        return MOPDObjective(config.mopd, domains, config.model.mtp_depths, parallel=parallel)

    def evaluators(self, config, tokenizer):
        if not config.mopd.eval_tasks:
            return [], []
        mixture = config.mopd.mixture()
        return [DomainAccuracy(mixture, tokenizer, config.mopd)], [mixture.close]


COMMAND = MOPD()
add_arguments, run = COMMAND.add_arguments, COMMAND.run
