"""RULER-style tasks (hybridtron.eval.ruler): samples deterministic for a seed, needles at the token positions the
sample states, prompts sized in the model's tokens, RULER's scorers on hand-made cases, the runner end to end on a
tiny random model, and the refusals (a length beyond the model, a haystack too short)."""

from __future__ import annotations

import itertools
import json
import re
from types import SimpleNamespace

import pytest

from hybridtron.data.stdlib import stdlib_files
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.eval.positions import parse_lengths
from hybridtron.eval.ruler import (
    SIZE_SLACK,
    TASKS,
    Haystack,
    check_length,
    generate_sample,
    plot_ruler,
    prompt_ids,
    run_ruler,
    string_match_all,
    string_match_part,
)
from hybridtron.infer.engine import HybridEngine
from hybridtron.model.lm import HybridLM

LENGTH = 2048  # the shortest length that holds every task's bare prompt with a 512-token vocabulary
NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")
CHAIN = re.compile(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d{5})")
# The most tokens one haystack unit takes with the test's tokenizer: a distractor needle with two uuids; a filler
# sentence, a word of source text, a listed word or a few of fwe's coded words for the others.
LARGEST_UNIT = {"needles": 100}


@pytest.fixture(scope="module")
def haystack():
    return Haystack([file.text for file in stdlib_files(("json", "text"))], "json+text")


@pytest.fixture(scope="module")
def tokenizer(haystack):
    return Tokenizer.train(haystack.documents[:20], 512)


@pytest.fixture(scope="module")
def samples(tokenizer, haystack):
    return {task: generate_sample(task, tokenizer, LENGTH, seed=3, index=1, haystack=haystack) for task in TASKS}


def test_samples_are_deterministic_for_task_length_seed_and_index(tokenizer, haystack, samples):
    for task, sample in samples.items():
        assert generate_sample(task, tokenizer, LENGTH, seed=3, index=1, haystack=haystack) == sample
        other = generate_sample(task, tokenizer, LENGTH, seed=3, index=2, haystack=haystack)
        assert other.prompt != sample.prompt and other.references != sample.references, task
    reseeded = generate_sample("niah_single_2", tokenizer, LENGTH, seed=4, index=1, haystack=haystack)
    assert reseeded.references != samples["niah_single_2"].references


def test_each_needle_is_at_the_token_positions_the_sample_states(tokenizer, samples):
    for task, sample in samples.items():
        spec, ids = TASKS[task], prompt_ids(tokenizer, sample)
        placed = [tokenizer.decode(ids[start:end]) for start, end in sample.needle_spans]
        assert ids[0] == tokenizer.bos_id
        if spec.kind == "niah":
            assert len(placed) == spec.keys * spec.values, task
            needles = [NEEDLE.fullmatch(text) for text in placed]
            assert all(needles), (task, placed)
            assert {m[1] for m in needles} == {spec.value_type}
            # every reference is a value hidden under one of the keys the question names
            asked = {m[3]: m[2] for m in needles}
            assert set(sample.references) <= set(asked), task
            question = sample.prompt.rsplit("\nWhich special magic", 1)[1]
            assert all(asked[value] in question for value in sample.references), task
            assert len(sample.references) == spec.queries * spec.values
        elif spec.kind == "vt":
            chain = [CHAIN.fullmatch(text) for text in placed]
            assert all(chain), placed
            assert [m[1] for m in chain] == sample.references  # in the chain's order
            assert chain[0][2] in sample.prompt[-200:] and all(m[2] == f"VAR {prev[1]}"
                                                                for prev, m in itertools.pairwise(chain))
        else:
            assert sample.needle_spans == []


def test_prompts_fill_the_length_less_the_answer_budget(tokenizer, haystack, samples):
    for task, sample in samples.items():
        spec = TASKS[task]
        target = LENGTH - spec.answer_budget
        assert len(prompt_ids(tokenizer, sample)) == sample.prompt_tokens <= target
        assert target - sample.prompt_tokens <= max(LARGEST_UNIT.get(spec.haystack, 32), SIZE_SLACK * target), task
    longer = generate_sample("niah_single_2", tokenizer, 2 * LENGTH, haystack=haystack)
    assert 2 * LENGTH - 128 - 32 <= longer.prompt_tokens <= 2 * LENGTH - 128


def test_what_the_haystacks_are_made_of(samples, haystack):
    assert "The grass is green. The sky is blue." in samples["niah_single_1"].prompt
    text = samples["niah_single_2"].prompt
    assert "The grass is green" not in text and any(line in text for d in haystack.documents
                                                    for line in d.splitlines()[:40] if len(line) > 40)
    assert samples["niah_multikey_2"].prompt.count("One of the special magic numbers") > 20
    cwe = samples["cwe"]
    listed = re.findall(r"\d+\. ([a-z]+)", cwe.prompt.rsplit("most often.\n", 1)[1].split("\nQuestion:")[0])
    assert len(cwe.references) == 10 and min(listed.count(w) for w in cwe.references) > max(
        listed.count(w) for w in set(listed) - set(cwe.references))
    fwe = samples["fwe"]
    coded = fwe.prompt.split("coded words. ", 1)[1].split("\nQuestion")[0].split()
    counts = [coded.count(word) for word in ["...", *fwe.references]]
    assert counts == sorted(counts, reverse=True) and counts[-1] > max(
        coded.count(w) for w in set(coded) - {"...", *fwe.references})


def test_scorers_as_ruler_scores():
    references = [["123", "456", "789"], ["abc"]]
    assert string_match_all(["it is 123 and 456", "ABC"], references) == 83.33  # (2/3 + 1) / 2
    assert string_match_all(["123 456", "nothing"], [["123", "456", "789"], ["x"]]) == 33.33
    assert string_match_all(["123 456 789"], [["123", "456", "789"]]) == 100.0
    assert string_match_all(["1 2"], [["123"]]) == 0.0
    assert string_match_part(["only 456", "nope"], references) == 50.0
    assert string_match_part(["The Answer: aBc"], [["x", "abc"]]) == 100.0


def test_refusals_name_the_task_the_length_and_the_limit(tokenizer):
    with pytest.raises(ValueError, match=r"niah_single_1 at length 8192: the model holds 4096 positions"):
        check_length("niah_single_1", 8192, 4096)
    check_length("niah_single_1", 4096, 4096)
    short = Haystack(["def f():\n    return 1\n"] * 3, "tiny")
    with pytest.raises(ValueError, match=r"niah_single_2 at length 2048: the haystack source 'tiny' is too short"):
        generate_sample("niah_single_2", tokenizer, 2048, haystack=short)
    with pytest.raises(ValueError, match=r"cwe at length 2048: the haystack source 'tiny' is too short"):
        generate_sample("cwe", tokenizer, 2048, haystack=short)
    with pytest.raises(ValueError, match=r"vt at length 256: the prompt without haystack .* takes \d+ tokens"):
        generate_sample("vt", tokenizer, 256)
    with pytest.raises(ValueError, match="unknown RULER task 'qa_1'"):
        generate_sample("qa_1", tokenizer, 2048)
    assert parse_lengths("1k, 4K,16k,1000") == [1024, 4096, 16384, 1000]
    with pytest.raises(ValueError, match="'4q' is not a length"):
        parse_lengths("1k,4q")


def test_runner_scores_every_task_at_every_length_through_the_engine(tokenizer, haystack, small_config):
    model = HybridLM(small_config(vocab_size=512, max_position_embeddings=640)).eval()
    engine = HybridEngine(model, tokenizer, model_name="tiny", speculative=False)
    tasks, lengths = ["niah_single_2", "fwe"], [384, 512]
    result = run_ruler(engine, tasks, lengths, samples=2, seed=1, haystack=haystack)
    assert result.tasks == tasks and result.lengths == lengths
    assert set(result.scores) == set(tasks) and all(set(row) == set(lengths) for row in result.scores.values())
    assert all(0 <= score <= 100 for row in result.scores.values() for score in row.values())
    assert [(s.task, s.length, s.index) for s in result.samples] == [
        (task, length, index) for task in tasks for length in lengths for index in range(2)]
    assert all(s.prediction is not None and s.score is not None for s in result.samples)
    again = run_ruler(engine, tasks, lengths, samples=2, seed=1, haystack=haystack)
    assert [s.prediction for s in again.samples] == [s.prediction for s in result.samples]
    assert again.scores == result.scores
    dumped = json.loads(json.dumps(result.to_dict()))
    assert dumped["scores"]["fwe"]["512"] == result.scores["fwe"][512] and "prompt" not in dumped["samples"][0]
    assert "niah_single_2" in result.table() and "average" in result.table()
    with pytest.raises(ValueError, match=r"fwe at length 1024: the model holds 640 positions"):
        run_ruler(engine, ["fwe"], [1024], samples=1, haystack=haystack)


class NeedleReader:
    """An engine that reads the asked key's needle out of the prompt and answers with its value: what a model that
    can do niah_single_1 says, so the runner is seen to give 100 where it is earned."""

    max_context = 4096

    def __init__(self, tokenizer):
        self.tokenizer, self.end_token_ids = tokenizer, (tokenizer.eos_id,)

    def generate(self, prompts, params, logprobs=True):
        answers = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt[1:])
            key = re.search(r"for (\S+) mentioned in the text above is$", text)[1]
            value = re.search(rf"for {key} is: (\d+)\.", text)[1]
            tokens = self.tokenizer.encode(f" {value}.\n")[:params.max_tokens - 1] + [self.tokenizer.eos_id]
            answers.append([SimpleNamespace(token_ids=tokens)])
        return answers


def test_runner_gives_full_marks_to_right_answers(tokenizer, tmp_path):
    result = run_ruler(NeedleReader(tokenizer), ["niah_single_1"], [1024, 2048], samples=3)
    assert result.scores == {"niah_single_1": {1024: 100.0, 2048: 100.0}} and result.average == {1024: 100.0,
                                                                                                2048: 100.0}
    assert all(s.prediction == f"{s.references[0]}." and s.score == 100.0 for s in result.samples)
    pytest.importorskip("matplotlib")
    assert plot_ruler(result, tmp_path / "ruler.png").stat().st_size > 0
