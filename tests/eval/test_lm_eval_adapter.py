"""The lm-evaluation-harness adapter (hybridtron.eval.lm_eval_adapter): `simple_evaluate(model="hybridtron", ...)` on
local tasks that need no download (task YAMLs over a JSONL, written here): the log-likelihoods the harness reports
are our model's forward (the sum of the continuation tokens' log-softmax given the context, fp32), rolling
log-likelihoods too, and generate_until gives the greedy continuation cut at the task's stop string."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from hybridtron.checkpoint import load_pretrained, save_pretrained
from hybridtron.data.chat import render_chat, save_tokenizer_files
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.model.lm import HybridLM

lm_eval = pytest.importorskip("lm_eval")  # the optional `eval` extra
from lm_eval.tasks import TaskManager  # noqa: E402 (lm_eval is optional: imported once it is known to be there)

from hybridtron.eval.lm_eval_adapter import MODEL_NAME, HybridtronLM, batch_rows  # noqa: E402 (needs lm_eval)

QUESTIONS = [
    {"question": "What is two plus three?", "choices": ["five", "four", "six"], "label": 0},
    {"question": "The quick brown", "choices": ["fox", "dog"], "label": 1},
    {"question": "", "choices": ["lazy", "dog"], "label": 0},
]
TEXTS = ["the quick brown fox jumps over the lazy dog", "2 + 3 = 5"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, small_config):
    """A small random model (every layer kind) saved as an HF checkpoint with its tokenizer files."""
    tokenizer = Tokenizer.train([q["question"] for q in QUESTIONS] * 8 + TEXTS * 8, 512)
    directory = tmp_path_factory.mktemp("lm_eval") / "hf"
    torch.manual_seed(0)
    save_pretrained(HybridLM(small_config(vocab_size=512, max_position_embeddings=128)), directory)
    save_tokenizer_files(tokenizer, directory, model_max_length=128)
    return directory


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Our model (as loaded, not laid out for decoding) and tokenizer, to compute what the harness should report."""
    return load_pretrained(checkpoint, dtype=torch.float32).eval(), Tokenizer.load(checkpoint)


def continuation_logprob(model, context_ids: list[int], continuation_ids: list[int]) -> float:
    """sum log softmax(model(context + continuation)) of the continuation's tokens, fp32."""
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logprobs = model(ids[:, :-1], mtp=False).logits[0].float().log_softmax(-1)
    positions = torch.arange(len(context_ids) - 1, ids.shape[1] - 1)
    return float(logprobs[positions, torch.tensor(continuation_ids)].sum())


def greedy_text(model, tokenizer, context: str, tokens: int) -> str:
    """`tokens` greedy tokens after bos + context, decoded, by full forwards (no cache, no engine)."""
    ids = [tokenizer.bos_id, *tokenizer.encode(context)]
    start = len(ids)
    with torch.no_grad():
        for _ in range(tokens):
            ids.append(int(model(torch.tensor([ids]), mtp=False).logits[0, -1].argmax()))
    return tokenizer.decode(ids[start:])


@pytest.fixture(scope="module")
def harness(checkpoint, reference, tmp_path_factory):
    """One `simple_evaluate` of three local tasks (multiple choice, rolling log-likelihood, generate_until), by the
    model's registered name; returns (its output, the stop string and the greedy text of the generation task)."""
    model, tokenizer = reference
    root = tmp_path_factory.mktemp("tasks")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({**q, "text": TEXTS[i % 2]}) + "\n" for i, q in enumerate(QUESTIONS)))
    # the stop string: a piece of what the model will generate, so that the cut is seen to happen
    greedy = greedy_text(model, tokenizer, QUESTIONS[0]["question"], 8)
    stop = greedy[len(greedy) // 2:len(greedy) // 2 + 2]
    assert len(stop) == 2 and greedy.index(stop) > 0, greedy
    common = {"dataset_path": "json", "test_split": "test",
              "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(root / "datasets")}}
    tasks = {
        "hybridtron_choice": {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                              "doc_to_choice": "{{choices}}", "doc_to_target": "label",
                              "metric_list": [{"metric": "acc"}]},
        "hybridtron_rolling": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                               "metric_list": [{"metric": "word_perplexity"}]},
        "hybridtron_generate": {"output_type": "generate_until", "doc_to_text": "{{question}}",
                                "doc_to_target": "{{text}}", "metric_list": [{"metric": "exact_match"}],
                                "generation_kwargs": {"until": [stop], "max_gen_toks": 8, "do_sample": False}},
    }
    for name, config in tasks.items():  # JSON is YAML
        (root / f"{name}.yaml").write_text(json.dumps({"task": name, **common, **config}))
    output = lm_eval.simple_evaluate(
        model=MODEL_NAME, model_args=f"pretrained={checkpoint},dtype=float32", tasks=sorted(tasks), device="cpu",
        batch_size=2, log_samples=True, task_manager=TaskManager(include_path=str(root), include_defaults=False))
    return output, stop, greedy


def test_the_harness_log_likelihoods_are_the_models_forward(harness, reference):
    model, tokenizer = reference
    output, _, _ = harness
    samples = output["samples"]["hybridtron_choice"]
    assert len(samples) == len(QUESTIONS)
    checked = 0
    for sample in samples:
        for (context, continuation), [(loglikelihood, _)] in zip(sample["arguments"], sample["resps"]):
            # the harness's split: the context's ids, then the rest of the whole text's (after bos)
            context_ids = [tokenizer.bos_id, *tokenizer.encode(context)]
            whole = [tokenizer.bos_id, *tokenizer.encode(context + continuation)]
            if not context:  # an empty context: the continuation alone, after bos
                whole = [tokenizer.bos_id, *tokenizer.encode(continuation)]
            expected = continuation_logprob(model, context_ids, whole[len(context_ids):])
            assert loglikelihood == pytest.approx(expected, abs=1e-5), (context, continuation)
            checked += 1
    assert checked == sum(len(q["choices"]) for q in QUESTIONS)
    assert output["results"]["hybridtron_choice"]["acc,none"] is not None


def test_rolling_log_likelihoods_are_the_models_forward(harness, reference):
    model, tokenizer = reference
    output, _, _ = harness
    for sample in output["samples"]["hybridtron_rolling"]:
        [text] = sample["arguments"][0]
        expected = continuation_logprob(model, [tokenizer.bos_id], tokenizer.encode(text))
        assert sample["resps"][0][0] == pytest.approx(expected, abs=1e-5)


def test_generate_until_is_greedy_and_cut_at_the_stop_string(harness):
    output, stop, greedy = harness
    samples = {s["arguments"][0][0]: s["resps"][0][0] for s in output["samples"]["hybridtron_generate"]}
    assert samples[QUESTIONS[0]["question"]] == greedy.split(stop)[0]
    assert all(stop not in text for text in samples.values()) and len(samples) == len(QUESTIONS)


def test_the_chat_template_when_asked(checkpoint):
    lm = HybridtronLM(str(checkpoint), device="cpu")
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    assert lm.apply_chat_template(messages) == render_chat(messages, add_generation_prompt=True).text
    # an assistant turn to be continued stays open
    prefilled = lm.apply_chat_template(messages + [{"role": "assistant", "content": "It is"}], False)
    assert prefilled.endswith("<|im_start|>assistant\nIt is")
    assert lm.chat_template(True) and lm.chat_template(False) is None
    # a chat-templated prompt starts with bos already: no second one
    ids = lm.tok_encode(lm.apply_chat_template(messages))
    assert ids[0] == lm.tokenizer.bos_id and ids[1] != lm.tokenizer.bos_id


def test_bad_model_arguments_are_one_line(checkpoint, tmp_path):
    for arguments, message in (({}, "needs pretrained=DIR"), ({"pretrained": str(checkpoint), "dtype": "int8"},
                                                               "dtype 'int8'"),
                               ({"pretrained": str(checkpoint), "device": "banana"},
                                "device 'banana': expected cpu, cuda or cuda:N")):
        with pytest.raises(ValueError, match=message) as error:
            HybridtronLM(**arguments)
        assert "\n" not in str(error.value)
    assert batch_rows("auto", None) == 16 and batch_rows("auto:4", 8) == 8 and batch_rows(3, 2) == 2
    with pytest.raises(ValueError, match="batch_size"):
        batch_rows("two", None)
    lm = HybridtronLM(str(checkpoint), device="cpu", max_length=32)
    with pytest.raises(ValueError, match=r"max_gen_toks 32 must lie in \[1, max_length 32\)"):
        lm.sampling_params({"max_gen_toks": 32, "until": []})


def test_each_kind_of_request_shows_a_progress_line(checkpoint, capsys):
    """The adapter's own line on stderr (lm_eval leaves progress to its models), `batch_size` requests at a time;
    `progress=False` (eval harness --quiet) or lm_eval's disable_tqdm: none. Generation in batches samples as one
    call would."""
    lm = HybridtronLM(str(checkpoint), device="cpu", batch_size=2, max_length=64)
    requests = [(None, [lm.tokenizer.bos_id, 5 + i], [7, 8]) for i in range(3)]
    scores = lm._loglikelihood_tokens(requests)
    err = capsys.readouterr().err
    assert "eval harness 0/3 loglikelihood requests" in err and "eval harness 3/3 loglikelihood requests" in err
    assert lm._loglikelihood_tokens(requests, disable_tqdm=True) == scores and capsys.readouterr().err == ""
    asked = [SimpleNamespace(args=(text, {"until": [], "max_gen_toks": 3, "do_sample": True, "temperature": 1.0}))
             for text in ["a", "b", "c"]]
    texts = lm.generate_until(asked)
    assert "eval harness 3/3 generate_until requests (100%)" in capsys.readouterr().err
    lm.progress, lm.batch_size = False, 3  # one call of all three
    assert lm.generate_until(asked) == texts and capsys.readouterr().err == ""
