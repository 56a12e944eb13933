"""`hybridtron eval` (a command of the registry, replacing `python -m hybridtron.post.evaluate`): a checkpoint's
pass@1, and pass@k with samples, on environments' held-out tasks; the held-out CE of conversations by domain."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from hybridtron.checkpoint import load_pretrained, save_pretrained
from hybridtron.cli import main
from hybridtron.data.chat import load_chat_tokenizer, save_tokenizer_files
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.envs import get_env
from hybridtron.eval import command
from hybridtron.eval.conversations import conversation_batches, held_out_loss
from hybridtron.eval.tasks import k_values, pass_at_k
from hybridtron.model.lm import HybridLM
from hybridtron.ops.cross_entropy import IGNORE_INDEX


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, small_config):
    """A small random model (every layer kind) with chat tokenizer files."""
    with get_env("math", levels=(1,)) as env:
        texts = [json.dumps(example) for example in env.sft_examples(40, 0)]
    tokenizer = Tokenizer.train(texts, 512)
    directory = tmp_path_factory.mktemp("eval") / "hf"
    torch.manual_seed(0)
    save_pretrained(HybridLM(small_config(vocab_size=512)), directory)
    save_tokenizer_files(tokenizer, directory, model_max_length=256)
    return directory


def test_pass_at_k_is_the_unbiased_estimate():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3, 2) / C(4, 2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    assert k_values(1) == [1] and k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="1 <= k <= samples"):
        pass_at_k(2, 1, 3)


def test_the_command_scores_each_environment_and_writes_json(checkpoint, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "tasks", "--model", str(checkpoint), "--env", "math,code", "--levels", "1", "--tasks", "3",
                 "--samples", "2", "--temperature", "1.0", "--max-tokens", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "math test (1): pass@1" in printed and "pass@2" in printed and "code test (1)" in printed
    result = json.loads(out.read_text())
    assert {"math", "code"} <= result.keys()
    assert result["math"]["tasks"] == 3 and result["math"]["samples"] == 2
    assert set(result["math"]["pass_at_k"]) == {"1", "2"}


def test_several_greedy_samples_are_refused(checkpoint, capsys):
    assert main(["eval", "tasks", "--model", str(checkpoint), "--tasks", "2", "--samples", "2"]) == 2
    assert "--samples 2 needs a --temperature above 0" in capsys.readouterr().err


def test_a_run_directory_is_read_through_its_export_and_progress_goes_to_stderr(checkpoint, capsys):
    """`--model RUN_DIR` (what `hybridtron pretrain --out` made): its hf/ export; the progress line counts the
    completions on stderr, apart from the results on stdout, and --quiet has none."""
    run_dir = checkpoint.parent
    assert main(["eval", "tasks", "--model", str(run_dir), "--tasks", "3", "--max-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert "math test (all levels): pass@1" in captured.out and "eval tasks" not in captured.out
    assert "eval tasks math 0/3 completions" in captured.err
    assert "eval tasks math 3/3 completions (100%)" in captured.err and "elapsed" in captured.err
    assert main(["eval", "tasks", "--model", str(run_dir), "--tasks", "1", "--max-tokens", "2", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_max_tokens_beyond_the_context_is_refused_before_any_completion(checkpoint, capsys, monkeypatch):
    """The checkpoint's context is 256 tokens: asked for more than the longest prompt leaves, generation would be
    cut by the context, not by --max-tokens; the command says the limit instead of running."""
    monkeypatch.setattr(command, "evaluate_env", lambda *a, **k: pytest.fail("evaluated"))
    assert main(["eval", "tasks", "--model", str(checkpoint), "--tasks", "3", "--max-tokens", "100000"]) == 2
    error = capsys.readouterr().err
    assert "--max-tokens 100000: the longest math prompt has" in error and "context is 256" in error
    room = int(error.split("at most ")[1].split()[0])
    assert 0 < room < 256 and len(error.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "0"], "--tasks 0: expected an integer >= 1"),
    (["--tasks", "-3"], "--tasks -3: expected an integer >= 1"),
    (["--batch-size", "0"], "--batch-size 0: expected an integer >= 1"),
    (["--max-tokens", "0"], "--max-tokens 0: expected an integer >= 1"),
    (["--temperature", "-1"], "--temperature -1.0: expected >= 0"),
    (["--threads", "-1"], "--threads -1"),
    (["--env", "banana"], "--env 'banana': unknown environment; known: code, copy, math"),
    (["--env", ","], "--env ',': unknown environment"),
    (["--levels", "1,x"], "--levels 1,x: expected difficulty levels"),
    (["--levels", "9"], "--levels 9: math: levels must be"),
    (["--json", "/nonexistent-dir/x.json"], "--json /nonexistent-dir/x.json: no directory /nonexistent-dir"),
])
def test_bad_tasks_options_are_one_line_naming_the_option_before_any_evaluation(checkpoint, argv, message, capsys,
                                                                                  monkeypatch):
    monkeypatch.setattr(command, "evaluate_env", lambda *a, **k: pytest.fail("evaluated"))
    assert main(["eval", "tasks", "--model", str(checkpoint), *argv]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1


@pytest.mark.parametrize("subcommand", ["tasks", "loss", "ruler", "harness"])
def test_a_training_checkpoint_is_refused_with_the_convert_command(subcommand, tmp_path, capsys):
    step = tmp_path / "run" / "checkpoints" / "step_000400"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")  # torch.distributed.checkpoint's
    extra = {"tasks": [], "loss": ["--lengths", "64"], "ruler": ["--lengths", "1k"], "harness": ["--tasks", "x"]}
    assert main(["eval", subcommand, "--model", str(step), *extra[subcommand]]) == 2
    error = capsys.readouterr().err
    assert f"--model {step} is a training checkpoint" in error and f"hybridtron convert --from {step}" in error
    assert len(error.strip().splitlines()) == 1


def test_conversation_loss_scores_only_the_assistant_turns(checkpoint):
    model = load_pretrained(checkpoint)
    tokenizer = load_chat_tokenizer(checkpoint)
    chats = {"math": [{"messages": [{"role": "user", "content": "1 + 1?"},
                                    {"role": "assistant", "content": "\\boxed{2}"}]}]}
    [batch] = conversation_batches(tokenizer, chats["math"], 256)
    ids, labels = batch.input_ids, batch.labels
    assert batch.seq_idx is None  # one conversation a row
    assert ids.shape == labels.shape and (labels != IGNORE_INDEX).sum() < labels.numel()
    with torch.no_grad():
        logits = model(ids, mtp=False).logits[0]
    scored = labels[0] != IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[scored], labels[0][scored])
    losses = held_out_loss(model, tokenizer, chats)
    assert losses["math"] == pytest.approx(float(expected), rel=1e-5) and losses["all"] == losses["math"]


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory, small_config):
    """A small random model that takes 4K positions, with its tokenizer, and a JSONL of long documents."""
    root = tmp_path_factory.mktemp("long")
    texts = [" ".join(f"word{(i * 7 + j) % 97}" for j in range(3000)) for i in range(6)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    tokenizer = Tokenizer.train(texts, 512)
    torch.manual_seed(0)
    save_pretrained(HybridLM(small_config(vocab_size=512, max_position_embeddings=4096)), root / "hf")
    save_tokenizer_files(tokenizer, root / "hf")
    return root


def test_eval_loss_writes_the_table_json_and_plot(long_checkpoint, tmp_path, capsys):
    out = tmp_path / "loss"
    # the run directory: its hf/ export
    assert main(["eval", "loss", "--model", str(long_checkpoint), "--lengths", "64,256", "--data",
                 str(long_checkpoint / "docs.jsonl"), "--held-out", "0", "--windows", "2", "--training-length",
                 "64", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "mean next-token CE" in captured.out
    assert "eval loss 4/4 windows (100%, length 256)" in captured.err and "elapsed" in captured.err
    report = json.loads((out / "loss_by_position.json").read_text())
    assert report["held_out"] == 0 and [length["length"] for length in report["lengths"]] == [64, 256]
    assert (out / "loss_by_position.png").stat().st_size > 0


def test_eval_ruler_scores_each_task_and_length(long_checkpoint, tmp_path, capsys):
    out = tmp_path / "ruler"
    assert main(["eval", "ruler", "--model", str(long_checkpoint), "--lengths", "1k", "--tasks",
                 "niah_single_1", "--samples", "2", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "niah_single_1" in captured.out
    assert "eval ruler 2/2 samples (100%, niah_single_1 at 1K)" in captured.err
    result = json.loads((out / "ruler.json").read_text())
    assert result["tasks"] == ["niah_single_1"] and len(result["samples"]) == 2
    assert 0 <= result["scores"]["niah_single_1"]["1024"] <= 100 and (out / "ruler.png").is_file()


@pytest.mark.parametrize("argv, message", [
    (["ruler", "--lengths", "8k", "--tasks", "niah_single_1"], "beyond"),
    (["ruler", "--lengths", "1k", "--tasks", "niah_single_9"], "unknown RULER task 'niah_single_9'"),
    # a length too short for the task's bare prompt: refused before the first length is decoded (no progress line)
    (["ruler", "--lengths", "1k,200", "--tasks", "niah_single_1"], "niah_single_1 at length 200: the prompt without"),
    (["loss", "--lengths", "1k,4q"], "'4q' is not a length"),
    (["loss", "--lengths", "8k"], "beyond the model's max_position_embeddings"),
    (["loss", "--lengths", "64", "--held-out", "0.01"], "holds out none of its documents"),
    (["loss", "--lengths", "64", "--held-out", "2"], "--held-out 2.0: expected a fraction in (0, 1), or 0"),
    (["loss", "--lengths", "64", "--windows", "0"], "--windows 0: expected an integer >= 1"),
    (["ruler", "--lengths", "1k", "--samples", "0"], "--samples 0: expected an integer >= 1"),
])
def test_bad_eval_input_is_one_line(long_checkpoint, argv, message, capsys):
    data = ["--data", str(long_checkpoint / "docs.jsonl")] if argv[0] == "loss" else []
    assert main(["eval", argv[0], "--model", str(long_checkpoint / "hf"), *argv[1:], *data]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1


def test_a_checkpoint_without_its_tokenizer_is_one_line(long_checkpoint, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((long_checkpoint / "hf" / name).read_bytes())
    for command in ("loss", "ruler"):
        assert main(["eval", command, "--model", str(bare), "--lengths", "64"]) == 2
        assert "tokenizer.json" in capsys.readouterr().err


@pytest.mark.parametrize("subcommand, argv, message", [
    ("loss", ["--lengths", "64", "--out", "FILE"], "--out FILE: a file, not a directory"),
    ("ruler", ["--lengths", "1k", "--out", "FILE/sub"], "--out FILE/sub: FILE is a file, so nothing can be written"),
    ("harness", ["--tasks", "x", "--output-path", "FILE/results"], "--output-path FILE/results: FILE is a file"),
])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_model_loads(long_checkpoint, subcommand, argv,
                                                                                  message, tmp_path, capsys,
                                                                                  monkeypatch):
    (tmp_path / "FILE").write_text("kept")
    monkeypatch.chdir(tmp_path)
    for name in ("load_model_and_tokenizer", "load_engine"):
        monkeypatch.setattr(command, name, lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["eval", subcommand, "--model", str(long_checkpoint), *argv]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1
    assert (tmp_path / "FILE").read_text() == "kept"


@pytest.mark.parametrize("argv, message", [
    (["--device", "banana"], "--device 'banana': expected cpu, cuda or cuda:N"),
    (["--limit", "-1"], "--limit -1: expected a number of examples per task"),
    (["--limit", "2.5"], "--limit 2.5: expected a number of examples per task"),
    (["--include-path", "no-such-dir"], "--include-path no-such-dir: no such directory"),
    (["--num-fewshot", "-2"], "--num-fewshot -2: expected an integer >= 0"),
    (["--batch-size", "0"], "--batch-size 0: expected an integer >= 1"),
    (["--tasks", " , "], "--tasks ' , ': expected lm_eval task names"),
    (["--tasks", "mine.yaml"], "--tasks mine.yaml: no such task file"),
])
def test_bad_harness_options_are_refused_before_lm_eval_is_imported(checkpoint, argv, message, capsys, monkeypatch,
                                                                    tmp_path):
    """lm_eval would take seconds to index its tasks before refusing these, some with a traceback; an import of the
    adapter here would fail (the module is None in sys.modules), so a refusal that names the option came first."""
    monkeypatch.setitem(sys.modules, "hybridtron.eval.lm_eval_adapter", None)
    monkeypatch.chdir(tmp_path)
    argv = argv if "--tasks" in argv else ["--tasks", "my_task", *argv]
    assert main(["eval", "harness", "--model", str(checkpoint), *argv]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1


def test_eval_harness_hands_its_arguments_to_lm_eval(checkpoint, monkeypatch):
    pytest.importorskip("lm_eval")  # the optional lm-evaluation-harness
    from hybridtron.eval import lm_eval_adapter
    seen = []
    monkeypatch.setattr(lm_eval_adapter, "main", seen.append)
    assert main(["eval", "harness", "--model", str(checkpoint.parent), "--tasks", "x", "--limit", "4"]) == 0
    [argv] = seen
    assert argv[:6] == ["--model", "hybridtron", "--model_args", f"pretrained={checkpoint}", "--tasks", "x"]
    assert argv[argv.index("--limit") + 1] == "4.0" and argv[argv.index("--device") + 1] == "cpu"
    assert main(["eval", "harness", "--model", str(checkpoint), "--tasks", "x", "--quiet"]) == 0
    assert seen[1][3] == f"pretrained={checkpoint},progress=False"


@pytest.mark.parametrize("raised, expected", [
    # what datasets raises without a network, after its retries (simulated: no network is touched)
    (ConnectionError("Couldn't reach 'EleutherAI/lambada_openai' on the Hub (LocalEntryNotFoundError)"),
     ["--tasks lambada_openai: a task's dataset could not be downloaded", "EleutherAI/lambada_openai",
      "--include-path", "HF_DATASETS_OFFLINE"]),
    # what lm_eval raises for a name it does not know, after indexing its tasks
    (ValueError("Tasks not found: lambada_openai"),
     ["--tasks lambada_openai: Tasks not found: lambada_openai (not among lm_eval's tasks", "ls tasks"]),
])
def test_what_lm_eval_raises_late_is_one_line_naming_the_option(checkpoint, monkeypatch, capsys, raised, expected):
    pytest.importorskip("lm_eval")
    from hybridtron.eval import lm_eval_adapter

    def fail(argv):
        raise raised

    monkeypatch.setattr(lm_eval_adapter, "main", fail)
    assert main(["eval", "harness", "--model", str(checkpoint), "--tasks", "lambada_openai"]) == 2
    error = capsys.readouterr().err
    assert all(text in error for text in expected) and len(error.strip().splitlines()) == 1
