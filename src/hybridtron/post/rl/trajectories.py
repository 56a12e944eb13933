"""RL on multi-turn, tool-using rollouts: how the rollout role (hybridtron.post.rl.rollout.RolloutRole) samples an
environment that declares tools (`Environment.tools`: `math-python`, `terminal`), and how a trajectory becomes one
RL sample.

The role runs the turn loop (`hybridtron.post.agentic.run_episodes`) over its rollout engine, `group_size`
trajectories of each task (a group), instead of one generation. A trajectory is one sample, as a single-turn
completion is (`TrajectorySample`, what `Completion` is to a single turn): its first prompt (the system turn with
the tools and the task) as the prompt, everything after it as the completion, and beside the completion

- `model_mask`: the tokens the model sampled. The tool responses and the generation prompts between turns are in the
  sequence (the model reads them) but not trained: the learner's labels there are ignored, so the policy loss, its
  rollout-vs-trainer correction (TIS / IcePop, per token), the KL and the MTP loss see the model's tokens alone;
- `logprobs`: each sampled token's log-prob under the distribution it was drawn from, turn after turn (0 at the
  environment's tokens), the behaviour log-probs of the correction;
- `expert_ids` (routing replay): the routing of turn k's engine call for the positions it was first to process,
  rows [end of turn k-1 - 1, end of turn k - 1) (turn 0 from row 0): the tool response and prompt before turn k,
  then turn k's own tokens, so the learner replays, at every model token, the routing that sampled it.

Environment tokens after the last model turn (the tool responses of a trajectory cut by its token budget) carry no
trained token and are dropped. The reward is the episode's verifier on the final state (`Trajectory.reward`); the
group's advantages, dynamic sampling and the curriculum are the single-turn role's. MOPD's rollouts (one a task) go
the same way, and a teacher scores the whole sequence, its scores read at the model's tokens only.

Both rollout engines sample the turns through their `generate` (`n=1` per trajectory, the weights' version
checked as for single-turn rollouts); the whole sequence, prompt and tool responses included, is bounded by the
policy's context (`max_position_embeddings`), each turn by the section's `max_new_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hybridtron.envs.agentic import ToolStats, Trajectory
from hybridtron.envs.base import Environment, Task
from hybridtron.post.agentic import run_episodes


@dataclass
class TrajectorySample:
    """One trajectory as the rollout role's sample (see the module docstring). Shapes: C completion tokens."""

    prompt_ids: list[int]
    token_ids: list[int]  # the completion: every turn, with the environment's tokens between them
    logprobs: torch.Tensor  # float32 [C]: the sampled log-prob of each model token, 0 at the environment's
    model_mask: torch.Tensor  # bool [C]: sampled by the model (trained) or written by the environment
    finish_reason: str  # the trajectory's finish (`Trajectory.finish`)
    expert_ids: dict[str, torch.Tensor] | None  # {router: [P + C - 1, K]}, the turns' routing joined
    reward: float
    turns: int
    stats: ToolStats

    @property
    def generated(self) -> int:
        """Tokens the model sampled."""
        return int(self.model_mask.sum())


def trajectory_sample(trajectory: Trajectory) -> TrajectorySample:
    """`trajectory` as one RL sample (see the module docstring)."""
    P = trajectory.prompt_length
    if not trajectory.turns:
        raise ValueError(f"task {trajectory.task.id}: its prompt ({P} tokens) fills the rollout's token budget (the "
                         "policy's max_position_embeddings); no turn was sampled")
    end = trajectory.turns[-1].end  # environment tokens after the last turn train nothing
    return TrajectorySample(
        prompt_ids=trajectory.token_ids[:P], token_ids=trajectory.token_ids[P:end],
        logprobs=torch.tensor(trajectory.logprobs[P:end], dtype=torch.float32),
        model_mask=torch.tensor(trajectory.model_mask[P:end], dtype=torch.bool), finish_reason=trajectory.finish,
        expert_ids=joined_routing(trajectory), reward=float(trajectory.reward),
        turns=len(trajectory.turns), stats=trajectory.stats)


def joined_routing(trajectory: Trajectory) -> dict[str, torch.Tensor] | None:
    """The turns' routing records joined into one per router, [end of the last turn - 1, K] int16: turn k's rows
    [end of turn k-1 - 1, end of turn k - 1) (see the module docstring). None without records (or a dense model)."""
    records = [turn.expert_ids for turn in trajectory.turns]
    if not all(records):
        return None
    joined = {}
    for name in records[0]:
        pieces, start = [], 0
        for k, (turn, record) in enumerate(zip(trajectory.turns, records)):
            stop = turn.end - 1
            if record[name].shape[0] < stop:  # an engine that left out positions it did not recompute
                raise ValueError(f"task {trajectory.task.id}: turn {k}'s routing record of router {name} holds "
                                 f"{record[name].shape[0]} positions, expected {stop} (its prompt and completion "
                                 "- 1); set routing_replay=false for this engine")
            pieces.append(record[name][start:stop])
            start = stop
        joined[name] = torch.cat(pieces).to(torch.int16)
    return joined


def sample_trajectories(engine, tokenizer, env: Environment, tasks: Sequence[Task], params, *, group_size: int,
                        version: int, expert_ids: bool, first_prompt: int, token_budget: int,
                        enable_thinking: bool | None) -> tuple[list[list[TrajectorySample]], dict[str, int]]:
    """`group_size` trajectories of each task through the rollout `engine` (a `RolloutEngine` holding `version`),
    grouped by task; and the MTP drafts accepted over all its turns (`drafts`, `verify_steps`). `first_prompt`: the
    position of `tasks[0]` in the step's list (so that ranks sharing a step draw different noise)."""
    drafted = {"drafts": 0, "verify_steps": 0}

    def generate(prompts, turn_params):
        rows = engine.generate(prompts, turn_params, n=1, version=version, expert_ids=expert_ids,
                               first_prompt=first_prompt * group_size)
        stats = getattr(engine, "last_stats", None)
        if stats is not None and getattr(stats, "steps", 0):
            drafted["drafts"] += stats.accepted
            drafted["verify_steps"] += stats.steps
        return [row[0] for row in rows]

    repeated = [task for task in tasks for _ in range(group_size)]
    trajectories = run_episodes(generate, tokenizer, env, repeated, params, token_budget=token_budget,
                                enable_thinking=enable_thinking)
    samples = [trajectory_sample(t) for t in trajectories]
    return [samples[i:i + group_size] for i in range(0, len(samples), group_size)], drafted


def trajectory_stats(samples: Sequence[TrajectorySample]) -> dict[str, float]:
    """A rollout batch's agentic statistics over its `samples` (every trajectory graded in the step, dropped groups
    too): tool calls, turns and model tokens per trajectory, the share of the calls well-formed (parsed, a declared
    tool, arguments that fit; 0 when there was no call) and the step's failed calls by kind (`tool_errors/<kind>`,
    every kind of `TOOL_ERRORS`)."""
    total = ToolStats()
    for sample in samples:
        total += sample.stats
    n = max(len(samples), 1)
    return {"tool_calls_per_trajectory": total.calls / n,
            "turns_per_trajectory": sum(s.turns for s in samples) / n,
            "tool_calls_well_formed": total.well_formed / total.calls if total.calls else 0.0,
            "model_tokens_per_trajectory": sum(s.generated for s in samples) / n,
            **{f"tool_errors/{kind}": float(count) for kind, count in total.errors.items()}}
