"""The engine's offline batch API (`HybridEngine.generate`, for rollouts) and its weight hand-over.

Every log-prob and expert id is checked against a teacher-forced forward of the model over the same tokens:
log-probs to 1e-5 (fp32), for greedy and sampled decoding, plain and speculative; expert ids exactly (as sets of
experts per position), and they replay.
"""

from __future__ import annotations

import pytest
import torch

from hybridtron.data.tokenizer import Tokenizer
from hybridtron.infer.decoder import DecodeBatch
from hybridtron.infer.engine import Completion, HybridEngine, generate_tokens
from hybridtron.infer.sampling import SamplingParams, probs_from_logits
from hybridtron.model.lm import HybridLM

LOGPROB = dict(rtol=0, atol=1e-5)
GREEDY = SamplingParams(temperature=0, max_tokens=8)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=8, seed=3)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(["def generate(model, prompt):\n    return model(prompt)\n" * 40], 600)


@pytest.fixture
def model(small_config):
    torch.manual_seed(0)
    return HybridLM(small_config(vocab_size=640, initializer_range=0.05)).eval()


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 600, (n,), generator=g).tolist() for n in lengths]


def teacher_forced(model, completion: Completion):
    """Logits [L, V] at the positions that produced each generated token, and the forward's routing [T, k]."""
    ids = completion.prompt_ids + completion.token_ids
    with torch.no_grad():
        out = model(torch.tensor([ids[:-1]]), mtp=False)
    start = len(completion.prompt_ids) - 1
    routing = {name: moe.last_expert_ids for name, moe in model.routers().items() if not name.startswith("mtp.")}
    return out.logits[0, start:], routing


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_logprobs_are_those_of_the_teacher_forced_distribution(model, tokenizer, params, speculative):
    """Greedy: log_softmax of the logits; sampled: the log of the filtered distribution the token was drawn from
    (temperature, top-k, top-p), which under speculative decoding is still the target's, never the drafter's."""
    engine = HybridEngine.from_model(model, tokenizer, speculative=speculative, draft_length=3)
    results = engine.generate(prompts_of([5, 9]), params, n=3)
    assert [len(r) for r in results] == [3, 3]
    for completion in (c for r in results for c in r):
        assert completion.logprobs.dtype == torch.float32
        assert completion.logprobs.shape == (len(completion.token_ids),) and completion.token_ids
        logits, _ = teacher_forced(model, completion)
        tokens = torch.tensor(completion.token_ids)[:, None]
        if params.greedy:
            assert logits.argmax(-1).tolist() == completion.token_ids
            expected = torch.log_softmax(logits.float(), -1).gather(-1, tokens)[:, 0]
        else:
            probs = probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
            expected = probs.gather(-1, tokens)[:, 0].log()
        torch.testing.assert_close(completion.logprobs, expected, **LOGPROB)
    if speculative and not params.greedy:
        assert engine.last_stats.accepted > 0  # accepted drafts were scored too


def test_samples_of_a_prompt_share_its_prefill(model, tokenizer, monkeypatch):
    """n samples per prompt: one prefill per distinct prompt, copied into the slots of its samples; greedy samples
    are then all the n = 1 completion, seeded samples differ and reproduce."""
    engine = HybridEngine.from_model(model, tokenizer, speculative=False)
    prompts = prompts_of([6, 6, 6])
    prefills = []
    stage = DecodeBatch.stage
    monkeypatch.setattr(DecodeBatch, "stage", lambda self, seq: prefills.append(seq.prompt) or stage(self, seq))
    greedy = engine.generate(prompts, GREEDY, n=4)
    assert prefills == prompts  # the 12 sequences: one prefill per prompt
    single = engine.generate(prompts, GREEDY, n=1)
    for samples, alone in zip(greedy, single):
        assert all(s.token_ids == alone[0].token_ids for s in samples)
    assert [c.prompt_ids for c in single[0]] == [prompts[0]]
    sampled = engine.generate(prompts, SAMPLED, n=4)
    assert len({tuple(s.token_ids) for s in sampled[0]}) > 1
    again = engine.generate(prompts, SAMPLED, n=4)
    assert [[s.token_ids for s in r] for r in sampled] == [[s.token_ids for s in r] for r in again]
    other = engine.generate(prompts, SamplingParams(temperature=0.8, max_tokens=8, seed=4), n=4)
    assert [[s.token_ids for s in r] for r in sampled] != [[s.token_ids for s in r] for r in other]
    prefills.clear()
    engine.generate(prompts_of([3, 8]) * 2, SAMPLED, n=2)
    assert prefills == prompts_of([3, 8])  # a prompt given twice is still prefilled once, not once per sample


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_expert_ids_are_those_of_the_teacher_forced_forward_and_replay(model, tokenizer, speculative):
    """One row per token the model read (the prompt, every generated token but the last): the experts of a
    teacher-forced forward over the same inputs, and replaying them leaves the loss unchanged."""
    engine = HybridEngine.from_model(model, tokenizer, speculative=speculative, draft_length=2)
    routers = [name for name in model.routers() if not name.startswith("mtp.")]
    for params in (GREEDY, SAMPLED):
        for completion in (c for r in engine.generate(prompts_of([4, 7]), params, n=2, expert_ids=True) for c in r):
            ids = completion.prompt_ids + completion.token_ids
            assert sorted(completion.expert_ids) == sorted(routers)
            _, routing = teacher_forced(model, completion)
            for name in routers:
                got = completion.expert_ids[name]
                assert got.dtype == torch.long and got.shape == (len(ids) - 1, model.config.num_experts_per_tok)
                assert torch.equal(got.sort(-1).values, routing[name].sort(-1).values), name
            inputs, labels = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
            with torch.no_grad():
                free = model(inputs, labels, mtp=False).loss
                replayed = model(inputs, labels, mtp=False,
                                 expert_ids={n: e[None] for n, e in completion.expert_ids.items()}).loss
            torch.testing.assert_close(replayed, free, rtol=1e-6, atol=1e-6)
    assert engine.generate(prompts_of([4]), SamplingParams(max_tokens=0), expert_ids=True)[0][0] \
        .expert_ids[routers[0]].shape[0] == 4  # nothing generated: the prompt's rows


def test_stop_strings_end_the_completion_at_the_token_that_completes_one(model, tokenizer):
    engine = HybridEngine.from_model(model, tokenizer, speculative=False)
    params = SamplingParams(temperature=0, max_tokens=24)
    prompts = prompts_of([5])
    free = engine.generate(prompts, params)[0][0]
    text = tokenizer.decode(free.token_ids)
    stop = next(text[i:i + 3] for i in range(3, len(text) - 3) if text[i:i + 3].strip())
    cut = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, stop=(stop,)))[0][0]
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[:len(cut.token_ids)]
    assert stop in tokenizer.decode(cut.token_ids) and stop not in tokenizer.decode(cut.token_ids[:-1])
    torch.testing.assert_close(cut.logprobs, free.logprobs[:len(cut.token_ids)])


def test_bad_inputs_are_value_errors(model, tokenizer):
    engine = HybridEngine.from_model(model, tokenizer)
    for n in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n must be an integer >= 1"):
            engine.generate([[5]], GREEDY, n=n)
    for prompts, message in (([], "non-empty list"), ("hello", "non-empty list"), ([[5], []], "prompt 1 is empty"),
                             ([[5, 700]], "outside the vocabulary"), ([[5.5]], "integer token ids"),
                             ([[5] * model.config.max_position_embeddings], "at most")):
        with pytest.raises(ValueError, match=message):
            engine.generate(prompts, GREEDY)


def test_from_model_decodes_its_own_copy_until_weights_are_handed_over(model, tokenizer):
    """The engine lays out and decodes a copy; the caller's model is untouched until `update_weights`, after which
    the engine emits what the updated model would; `copy_weights=False` decodes the caller's model as it is."""
    storage = {name: (p.stride(), p.data_ptr()) for name, p in model.named_parameters()}
    engine = HybridEngine.from_model(model, tokenizer, speculative=False)
    assert engine.model is not model and engine.model.lm_head.weight.t().is_contiguous()
    assert {name: (p.stride(), p.data_ptr()) for name, p in model.named_parameters()} == storage
    prompts = prompts_of([6])
    before = engine.generate(prompts, GREEDY)[0][0].token_ids
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
    assert engine.generate(prompts, GREEDY)[0][0].token_ids == before
    engine.update_weights(model)
    expected = generate_tokens(model, prompts, SamplingParams(temperature=0, max_tokens=8,
                                                              stop_token_ids=engine.end_token_ids))[0]
    assert engine.generate(prompts, GREEDY)[0][0].token_ids == expected != before
    assert engine.model.lm_head.weight.t().is_contiguous()  # the hand-over keeps the engine's layout
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights({"lm_head.weight": model.lm_head.weight})
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights({**model.state_dict(), "lm_head.weight": model.lm_head.weight[:5]})
    shared = HybridEngine.from_model(model, tokenizer, copy_weights=False)
    assert shared.model is model and model.lm_head.weight.is_contiguous()
