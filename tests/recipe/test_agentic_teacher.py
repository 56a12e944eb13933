"""The recipe's agentic teacher (hybridtron.recipe.stages): tool-use SFT on the terminal environment's expert
trajectories, then RLVR in it; a teacher of MOPD's panel with its environment among MOPD's prompts, in both
iterations and in the ablation without warmup; and the warmup's data of its domain, the teacher's whole trajectories
through the turn loop with the real tool responses, which SFT renders with the tool and never trains on."""

from __future__ import annotations

import pytest
import torch

from hybridtron.data.chat import load_chat_tokenizer, tokenize_chat
from hybridtron.data.tokenizer import IM_END
from hybridtron.envs import get_env
from hybridtron.envs.agentic import BASH_TOOL
from hybridtron.infer.scheduler import Completion
from hybridtron.post import teachers
from hybridtron.post.mopd_warmup import warmup_conversations
from hybridtron.recipe.stage import TEACHER_TEMPERATURE
from hybridtron.recipe.stages import (apply_changes, data_draws, pipeline_model, preset_config, stage_run,
                                      upstream)


def test_the_agentic_teacher_is_tool_use_sft_then_terminal_rlvr_in_every_mopd_panel(tmp_path):
    config = preset_config("micro")
    model = pipeline_model(config)
    teacher_sft = stage_run("agentic_teacher_sft", config, tmp_path, model=model)[1]
    assert (teacher_sft.base_model, teacher_sft.data) == (str(tmp_path / "sft" / "hf"), "env:terminal")
    assert teacher_sft.sft.seq_len >= 1024  # a whole terminal conversation of the micro tokenizer in a row
    teacher = stage_run("agentic_teacher", config, tmp_path, model=model)[1]
    assert (teacher.base_model, teacher.env) == (str(tmp_path / "agentic_teacher_sft" / "hf"), "terminal")
    assert model.max_position_embeddings >= 2048  # a terminal prompt (~570 tokens) and its turns fit the context
    for name in ("mopd_1", "mopd_2", "mopd_no_warmup"):  # the ablation distils from the same panel
        mopd = stage_run(name, config, tmp_path, model=model)[1]
        assert mopd.teachers["terminal"] == str(tmp_path / "agentic_teacher" / "hf"), name
        assert mopd.mopd.envs == ("math", "code", "terminal") and mopd.mopd.warmup_steps == 0, name
        assert "agentic_teacher" in upstream(name, config)
    tiny = preset_config("tiny")
    assert tiny.stages["mopd_1"].settings["mopd.domain_weights"] == (0.7, 0.2, 0.1)
    # the warmup's terminal part: expert trajectories, or with teacher_samples the agentic teacher's answers
    terminal = data_draws("mopd_warmup", config)[-1]
    assert (terminal.domain, terminal.examples, terminal.teacher) == ("terminal", 2, "")
    asked = apply_changes(config, {"mopd_warmup": {"teacher_samples": 2, "terminal_examples": 3}}, "test")
    terminal = data_draws("mopd_warmup", asked)[-1]
    assert (terminal.examples, terminal.teacher, terminal.samples) == (3, "agentic_teacher", 2)
    assert "agentic_teacher" in upstream("mopd_warmup", asked)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, small_config, random_policy):
    """A random teacher with the context of a terminal conversation (its turns are scripted below)."""
    directory = tmp_path_factory.mktemp("agentic_teacher") / "hf"
    words = ["How many", "files", "bash", "grep", "boxed", "tool_call", "ERROR"] + [str(i) for i in range(50)]
    return random_policy(directory, small_config(vocab_size=512, max_position_embeddings=2048), words, texts=200)


def scripted_generate(tokenizer, tasks):
    """The turns of a teacher that runs each task's solving command, then boxes the count it printed, wrong (one
    more) at every even place of a batch: each turn's tokens, one completion a prompt, as `engine_generate`'s."""
    def generate(prompts, params):
        out = []
        for place, ids in enumerate(prompts):
            text = tokenizer.decode(ids)
            task = next(t for t in tasks if t.prompt in text)
            if "<tool_response>" not in text:
                reply = task.reference
            else:
                printed = text.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0].split()[-1]
                reply = f"The answer is \\boxed{{{int(printed) + (place % 2 == 0)}}}."
            tokens = tokenizer.encode(reply) + [tokenizer.token_id(IM_END)]
            out.append(Completion(list(ids), tokens, torch.zeros(len(tokens)), "stop"))
        return out
    return generate


def test_the_warmup_data_of_a_tool_environment_are_the_teachers_trajectories(teacher_dir, monkeypatch):
    """`warmup_conversations` on the terminal environment: each answer is the teacher's trajectory through the turn
    loop (its call, the sandbox's real output as a `tool` message, its answer), carrying the bash tool; "verified"
    keeps the first try the episode's verifier scores 1 and leaves out a task never solved. Rendered as SFT renders
    it, only the teacher's turns are trained."""
    with get_env("terminal", levels=(1,)) as env:
        tasks = env.tasks("train", 2, 1)
        monkeypatch.setattr(teachers, "engine_generate", lambda engine: scripted_generate(engine.tokenizer, tasks))

        def answers(kind, tries):
            return warmup_conversations([(env, 2)], kind, teacher_for=lambda domain: str(teacher_dir), seed=1,
                                        temperature=TEACHER_TEMPERATURE, max_tokens=lambda domain: 64, tries=tries,
                                        batch_size=8, setting="mopd_warmup.terminal_examples=2")

        sampled, verified = answers("teacher", 1), answers("verified", 2)

    # tasks x tries = [t0, t1, t0, t1]: t0 always at an even place (answered wrong), t1 at odd ones (right)
    assert len(sampled) == 2 and len(verified) == 1  # one try each kept whatever it scored; t0 never solved
    for example, task in zip(sampled + verified, [tasks[0], tasks[1], tasks[1]]):
        messages = example["messages"]
        assert example["domain"] == "terminal" and example["tools"] == [BASH_TOOL]
        assert messages[:2] == env.prompt_messages(task)
        assert [m["role"] for m in messages[2:]] == ["assistant", "tool", "assistant"]
        assert messages[2]["content"] == task.reference  # the teacher's call, as sampled
        assert messages[3]["content"].strip() == task.answer  # the sandbox's own output of grep | wc -l
    assert [example["messages"][-1]["content"] for example in sampled + verified] == [
        f"The answer is \\boxed{{{int(tasks[0].answer) + 1}}}.", *[f"The answer is \\boxed{{{tasks[1].answer}}}."] * 2]
    example = verified[0]
    chat = tokenize_chat(load_chat_tokenizer(teacher_dir, vocab_size=512), example["messages"], tools=example["tools"])
    trained_roles = {chat.roles[turn] for turn in chat.turns[chat.trained(True)]}
    assert trained_roles == {"assistant"}  # the tool response, the task and the tools' declaration: prompt
