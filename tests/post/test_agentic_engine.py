"""The turn loop driven by hybridtron's engine: a trajectory's sampled log-probs, stored per token across turns, are
what a full forward of the whole sequence (prompt, tool responses and all) gives at the model's tokens, which is
what RL on trajectories trains on."""

from __future__ import annotations

import pytest
import torch

from hybridtron.data.tokenizer import Tokenizer
from hybridtron.envs import get_env
from hybridtron.infer.engine import HybridEngine
from hybridtron.infer.sampling import SamplingParams
from hybridtron.model.lm import HybridLM
from hybridtron.post.agentic import engine_generate, run_episodes


@pytest.fixture(scope="module")
def engine(small_config):
    tokenizer = Tokenizer.train(["print(2 ** 64)\nThe answer is \\boxed{7}.\n"] * 30, vocab_size=512)
    torch.manual_seed(0)
    model = HybridLM(small_config(vocab_size=512, max_position_embeddings=1024, initializer_range=0.05)).eval()
    return HybridEngine(model, tokenizer, model_name="tiny", speculative=False)


def test_sampled_logprobs_match_a_forward_of_the_whole_trajectory(engine):
    env = get_env("math-python", levels=(1,))
    tasks = env.tasks("train", 2, seed=0)
    model_turns = engine_generate(engine)

    def generate(prompts, params):
        """The first turn scripted (the reference python call), every later one sampled by the engine."""
        out = model_turns(prompts, params)
        for i, ids in enumerate(prompts):
            text = engine.tokenizer.decode(ids)
            if "<tool_response>" not in text:
                task = next(t for t in tasks if t.prompt in text)
                tokens = engine.tokenizer.encode(task.reference) + [engine.tokenizer.token_id("<|im_end|>")]
                out[i] = type(out[i])(list(ids), tokens, torch.zeros(len(tokens)), "stop")
        return out

    trajectories = run_episodes(generate, engine.tokenizer, env, tasks,
                                SamplingParams(max_tokens=12, temperature=1.0, seed=3), max_turns=2)
    for trajectory in trajectories:
        assert len(trajectory.turns) == 2 and trajectory.turns[0].results[0].error is None
        sampled = trajectory.turns[1]
        ids = torch.tensor(trajectory.token_ids)
        with torch.no_grad():
            logits = engine.model(input_ids=ids[None, :-1], mtp=False).logits[0].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]
        span = slice(sampled.start - 1, sampled.end - 1)  # the logits at t predict token t + 1
        stored = torch.tensor(trajectory.logprobs[sampled.start:sampled.end])
        torch.testing.assert_close(logprobs[span], stored, atol=2e-4, rtol=0)
        assert sampled.end - sampled.start >= 2 and all(trajectory.model_mask[sampled.start:sampled.end])
