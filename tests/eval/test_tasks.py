"""`evaluate_env`: completions from the chat template's generation prompt, graded by the environment; pass@k of
sampled completions."""

from __future__ import annotations

import pytest

from hybridtron.data.chat import tokenize_chat
from hybridtron.data.tokenizer import IM_END, Tokenizer
from hybridtron.infer.engine import generate_tokens
from hybridtron.infer.sampling import SamplingParams
from hybridtron.model.lm import HybridLM
from hybridtron.envs import Environment, Task
from hybridtron.eval.tasks import evaluate_env, pass_at_k


class Recorder(Environment):
    """Rewards 1.0 for the completions it is told are right; remembers what it was asked to grade."""

    system_prompt = "Answer."

    def __init__(self, right: set[str] = frozenset()):
        self.right, self.graded = set(right), []

    def reward(self, task, completion):
        self.graded.append(completion)
        return 1.0 if completion in self.right else 0.0


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(["What is 1 + 2? The answer is 3.", "Answer the question."] * 20, 512)


TASKS = [Task(prompt=f"What is {a} + {b}?", difficulty=1 + a % 2) for a, b in [(1, 2), (2, 3), (3, 4)]]


def test_completions_are_the_models_greedy_continuations_graded_by_the_env(tokenizer, small_config):
    model = HybridLM(small_config(vocab_size=512, max_position_embeddings=128)).eval()
    env = Recorder()
    result = evaluate_env(model, tokenizer, env, TASKS, max_tokens=6, batch_size=2)
    stop = (tokenizer.token_id(IM_END), tokenizer.eos_id)
    prompts = [tokenize_chat(tokenizer, env.prompt_messages(t), add_generation_prompt=True).ids.tolist()
               for t in TASKS]
    expected = generate_tokens(model, prompts, SamplingParams(temperature=0, max_tokens=6, stop_token_ids=stop))
    texts = [tokenizer.decode(t[:-1] if t and t[-1] in stop else t) for t in expected]
    assert result.completions == texts == env.graded
    assert result.tasks == 3 and result.pass_at_1 == 0.0

    env = Recorder(right={texts[0], texts[2]})
    result = evaluate_env(model, tokenizer, env, TASKS, max_tokens=6, batch_size=3)
    solved = [t in env.right for t in texts]
    assert result.pass_at_1 == pytest.approx(sum(solved) / 3)
    assert result.by_difficulty == {1: solved[1] / 1, 2: (solved[0] + solved[2]) / 2}
    assert 0 < result.mean_completion_tokens <= 6 and 0 <= result.truncated_share <= 1


def test_an_opened_thinking_block_is_part_of_what_is_graded(tokenizer, small_config):
    model = HybridLM(small_config(vocab_size=512, max_position_embeddings=128)).eval()
    env = Recorder()
    evaluate_env(model, tokenizer, env, TASKS[:1], max_tokens=3, enable_thinking=True)
    assert env.graded[0].startswith("<think>\n")


def test_no_tasks_is_an_error(tokenizer, small_config):
    with pytest.raises(ValueError, match="no tasks"):
        evaluate_env(HybridLM(small_config(vocab_size=512)), tokenizer, Recorder(), [])


def test_a_sampled_completion_depends_on_its_task_and_seed_not_on_the_batch_it_fell_in(tokenizer, small_config):
    """The task at position i of the list has noise key (seed, i) whatever the batch size, so repeated tasks in
    different batches are different samples, and best-of-k sampling (the pipeline's warmup data) draws k tries."""
    model = HybridLM(small_config(vocab_size=512, max_position_embeddings=128)).eval()
    repeated = [TASKS[0]] * 6
    one_batch = evaluate_env(model, tokenizer, Recorder(), repeated, max_tokens=8, batch_size=6, temperature=1.0,
                             seed=3)
    batches_of_two = evaluate_env(model, tokenizer, Recorder(), repeated, max_tokens=8, batch_size=2,
                                  temperature=1.0, seed=3)
    assert one_batch.completions == batches_of_two.completions
    assert len(set(one_batch.completions)) > 1  # an untrained model at T = 1: six tries, not one repeated


class Scripted(Recorder):
    """Grades the i-th completion it is given by `script[i]`, whatever it says: a known number of right samples per
    task."""

    def __init__(self, script: list[float]):
        super().__init__()
        self.script, self.tasks = script, []

    def rewards(self, tasks, completions):
        self.tasks, self.graded = list(tasks), list(completions)
        return list(self.script)


def test_pass_at_k_of_sampled_completions_is_the_unbiased_estimate(tokenizer, small_config):
    """n = 4 samples of two tasks, c = 1 and c = 3 of them right. By hand (Chen et al. 2021, 1 - C(n-c, k) / C(n, k)):
    task 0: pass@1 1/4, pass@2 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5, pass@4 1; task 1: pass@1 3/4, pass@2 1 (n - c = 1 < 2:
    every pair holds a right one), pass@4 1. The figures are the means over the tasks."""
    model = HybridLM(small_config(vocab_size=512, max_position_embeddings=128)).eval()
    env = Scripted([0, 1, 0, 0] + [1, 1, 0, 1])
    result = evaluate_env(model, tokenizer, env, TASKS[:2], samples=4, max_tokens=6, batch_size=3, temperature=1.0)
    assert env.tasks == [TASKS[0]] * 4 + [TASKS[1]] * 4, "each task's samples graded together, in task order"
    assert len(set(env.graded[:4])) > 1, "four samples of a task at T = 1, not one repeated"
    assert result.samples == 4 and result.tasks == 2
    assert result.pass_at_k == pytest.approx({1: (1 / 4 + 3 / 4) / 2, 2: (0.5 + 1.0) / 2, 4: 1.0})
    assert result.pass_at_1 == result.pass_at_k[1] and result.mean_reward == pytest.approx(4 / 8)
    # TASKS[0] is level 2, TASKS[1] level 1: pass@1 (c / n) per level
    assert result.by_difficulty == pytest.approx({1: 3 / 4, 2: 1 / 4})
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5) and pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)
    with pytest.raises(ValueError, match="a temperature > 0"):  # greedy samples would all be the same
        evaluate_env(model, tokenizer, env, TASKS[:2], samples=4)


def test_a_completion_the_context_cut_is_reported_as_such_not_as_max_tokens(tokenizer, small_config):
    """A context 3 tokens past the longest prompt, and max_tokens far beyond it: the completions that never closed
    their turn were cut by the context, and the summary says so."""
    env = Recorder()
    longest = max(len(tokenize_chat(tokenizer, env.prompt_messages(t), add_generation_prompt=True).ids)
                  for t in TASKS)
    model = HybridLM(small_config(vocab_size=512, max_position_embeddings=longest + 3)).eval()
    result = evaluate_env(model, tokenizer, env, TASKS, max_tokens=1000)
    assert result.context == longest + 3 and result.truncated_share == 0
    assert result.context_cut_share > 0 and result.mean_completion_tokens <= 3 + longest
    assert f"cut by the model's context ({longest + 3} tokens)" in result.format()
    assert "0% cut at max_tokens" in result.format()
    capped = evaluate_env(model, tokenizer, env, TASKS, max_tokens=1)
    assert capped.context_cut_share == 0 and "cut by the model's context" not in capped.format()
