"""Plain generation: batched chunked prefill, decode against the full forward, sampling, stops, limits, text, CLI."""

import re
import time

import pytest
import torch

from hybridtron.cli import main
from hybridtron.checkpoint import save_pretrained
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.infer.decoder import Decoder
from hybridtron.infer.engine import generate_tokens
from hybridtron.infer.fastpath import lay_out_for_decoding
from hybridtron.infer.generate import summary
from hybridtron.infer.speculative import AcceptanceStats
from hybridtron.infer.text import TextStream, stream_text
from hybridtron.infer.sampling import SamplingParams
from hybridtron.model.lm import HybridLM

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture
def model(small_config):
    return HybridLM(small_config()).eval()


def random_prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_batched_greedy_decode_equals_the_full_forward(model):
    """Prompts of different lengths in one batch: every generated token is the argmax of the model's no-cache
    forward over the prompt and the tokens before it (teacher forcing)."""
    prompts = random_prompts(model.config.vocab_size, [5, 1, 17, 9])
    outputs = generate_tokens(model, prompts, GREEDY)
    for prompt, tokens in zip(prompts, outputs):
        assert len(tokens) == GREEDY.max_tokens
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0]
        assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == tokens


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_chunked_prefill_matches_one_pass(model, chunk):
    prompts = random_prompts(model.config.vocab_size, [19, 6])
    whole = Decoder(model, prompts, GREEDY, prefill_chunk=64)
    chunked = Decoder(model, prompts, GREEDY, prefill_chunk=chunk)
    torch.testing.assert_close(chunked.prompt_logits, whole.prompt_logits, rtol=1e-5, atol=1e-5)
    assert generate_tokens(model, prompts, GREEDY, prefill_chunk=chunk) == generate_tokens(model, prompts, GREEDY)


def test_decoding_layout_changes_only_how_weights_are_stored(model):
    """`lay_out_for_decoding` (an engine's explicit step) stores the model's weight matrices transposed in memory
    (faster matrix-vector products on the CPU): shapes, values and the forward are unchanged, and the model still
    trains."""
    ids = torch.randint(3, model.config.vocab_size, (2, 9))
    state = {name: value.clone() for name, value in model.state_dict().items()}
    with torch.no_grad():
        before = model(ids).logits
    lay_out_for_decoding(model)
    assert model.lm_head.weight.t().is_contiguous()
    assert model.moe_layers()[0].experts.up_proj.transpose(1, 2).is_contiguous()
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
    plain = HybridLM(model.config).eval()
    plain.load_state_dict(state)
    assert generate_tokens(model, [[3, 4]], GREEDY) == generate_tokens(plain, [[3, 4]], GREEDY)
    model(ids, torch.roll(ids, -1, dims=1)).loss.backward()
    assert model.lm_head.weight.grad.shape == model.lm_head.weight.shape


def test_sampling_is_seeded_and_filtered(model):
    prompts = random_prompts(model.config.vocab_size, [4, 8])
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7)
    first, again = generate_tokens(model, prompts, params), generate_tokens(model, prompts, params)
    other = generate_tokens(model, prompts, SamplingParams(temperature=1.0, max_tokens=10, seed=8))
    assert first == again and first != other
    assert generate_tokens(model, prompts, SamplingParams(top_k=1, max_tokens=10, seed=3)) == \
        generate_tokens(model, prompts, SamplingParams(temperature=0, max_tokens=10))
    # top_k = 5: every sampled token is among the 5 most likely ones under teacher forcing
    tokens = generate_tokens(model, prompts[:1], SamplingParams(top_k=5, max_tokens=10, seed=1))[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0] + tokens])).logits[0, len(prompts[0]) - 1:-1]
    top5 = logits.topk(5, dim=-1).indices
    assert all(token in top5[i].tolist() for i, token in enumerate(tokens))


def test_stop_tokens_max_tokens_and_finish_reasons(model):
    prompts = random_prompts(model.config.vocab_size, [6, 3])
    free = generate_tokens(model, prompts, GREEDY)
    stop_token = free[0][4]
    first_stop = free[0].index(stop_token)
    decoder = Decoder(model, prompts, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_token,)))
    for _ in decoder:
        pass
    assert decoder.sequences[0].tokens == free[0][:first_stop + 1]
    assert decoder.sequences[0].finish_reason == "stop"
    if stop_token not in free[1]:
        assert decoder.sequences[1].tokens == free[1] and decoder.sequences[1].finish_reason == "length"
    assert generate_tokens(model, prompts, SamplingParams(temperature=0, max_tokens=0)) == [[], []]
    assert generate_tokens(model, prompts, SamplingParams(temperature=0, max_tokens=3)) == [t[:3] for t in free]


def test_context_limit(model):
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"prompt 1 has {limit} tokens.*at most {limit - 1}"):
        Decoder(model, [[5], [5] * limit], GREEDY)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        Decoder(model, [[]], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Decoder(model, [[model.config.vocab_size]], GREEDY)
    with pytest.raises(ValueError, match="max_context"):
        Decoder(model, [[5]], GREEDY, max_context=limit + 1)
    # a small context: generation stops when prompt + generated tokens fill it
    decoder = Decoder(model, [[5] * 6, [7] * 2], SamplingParams(temperature=0, max_tokens=50), max_context=10)
    for _ in decoder:
        pass
    assert [len(s.tokens) for s in decoder.sequences] == [4, 8]
    assert [s.finish_reason for s in decoder.sequences] == ["length", "length"]
    free = generate_tokens(model, [[7] * 2], SamplingParams(temperature=0, max_tokens=8))
    assert decoder.sequences[1].tokens == free[0]


def test_state_quant_generation_runs_and_stays_close(model):
    prompts = random_prompts(model.config.vocab_size, [5, 9])
    base = Decoder(model, prompts, GREEDY)
    rounded = Decoder(model, prompts, GREEDY, state_quant="fp16_sr")
    torch.testing.assert_close(rounded.prompt_logits, base.prompt_logits, rtol=1e-2, atol=1e-3)
    assert len(generate_tokens(model, prompts, GREEDY, state_quant="int8_rtn")[0]) == GREEDY.max_tokens


# ------------------------------------------------------------------------------------------------------ text
@pytest.fixture(scope="module")
def tokenizer():
    text = ("def generate_tokens(model, prompt):\n    return model(prompt)  # héllo wörld 🙂\n" * 40
            + "The quick brown fox jumps over the lazy dog. " * 40)
    return Tokenizer.train([text], 600)


def test_text_stream_concatenates_to_the_decoded_text(tokenizer):
    text = "héllo 🙂 wörld, the lazy dog"
    ids = [b for ch in text for b in tokenizer.encode(ch)]  # per-character tokens: multi-byte ones split
    stream = TextStream(tokenizer.decode)
    pieces = [stream.push(t)[0] for t in ids] + [stream.finish()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)


@pytest.mark.parametrize("stop, expected", [("wörld", "héllo 🙂 "), ("lazy", "héllo 🙂 wörld, the "),
                                            ("absent", "héllo 🙂 wörld, the lazy dog")])
def test_text_stream_stop_strings(tokenizer, stop, expected):
    ids = tokenizer.encode("héllo 🙂 wörld, the lazy dog")
    stream = TextStream(tokenizer.decode, stop=(stop, "zzz"))
    pieces, stopped = [], False
    for token in ids:
        piece, stopped = stream.push(token)
        pieces.append(piece)
        if stopped:
            break
    if not stopped:
        pieces.append(stream.finish())
    assert "".join(pieces) == expected
    assert stopped == (stop != "absent")


def test_text_stream_holds_back_a_possible_stop_and_hides_stop_tokens(tokenizer):
    stream = TextStream(tokenizer.decode, stop=("dog.",), stop_token_ids=(2,))
    out = "".join(stream.push(t)[0] for t in tokenizer.encode("the lazy do"))
    assert out == "the lazy "  # "do" might begin "dog."
    piece, stopped = stream.push(2)
    assert (piece, stopped) == ("do", True)


def test_stream_text_of_a_decoder(small_config, tokenizer):
    model = HybridLM(small_config(vocab_size=640)).eval()
    prompts = [tokenizer.encode("def generate")]
    params = SamplingParams(temperature=0, max_tokens=15)
    tokens = generate_tokens(model, prompts, params)[0]
    pairs = list(stream_text(Decoder(model, prompts, params), tokenizer.decode))
    assert [t for t, _ in pairs] == tokens
    assert "".join(d for _, d in pairs) == tokenizer.decode(tokens)


# ------------------------------------------------------------------------------------------------------- CLI
def test_generate_command_streams_the_greedy_text(tmp_path, small_config, tokenizer, capsys):
    config = small_config(vocab_size=640, max_position_embeddings=64)
    model = HybridLM(config).eval()
    save_pretrained(model, tmp_path / "ckpt")
    tokenizer.save(tmp_path / "ckpt")
    prompt = "def generate_tokens(model"
    args = ["generate", "--model", str(tmp_path / "ckpt"), "--prompt", prompt, "--max-tokens", "9",
            "--temperature", "0"]
    assert main(args + ["--no-speculative"]) == 0
    plain = capsys.readouterr()
    ids = generate_tokens(model, [tokenizer.encode(prompt)], SamplingParams(temperature=0, max_tokens=9,
                                                                     stop_token_ids=(2, 4)))[0]
    expected = tokenizer.decode([t for t in ids if t not in (2, 4)])
    assert plain.out == expected + "\n"
    assert "tokens/s" in plain.err and "; plain decode]" in plain.err
    assert main(args + ["--speculative", "--draft-length", "3"]) == 0
    speculative = capsys.readouterr()
    assert speculative.out == plain.out and "mean acceptance length" in speculative.err


def test_generate_command_errors(tmp_path, small_config, capsys):
    save_pretrained(HybridLM(small_config()), tmp_path / "ckpt")
    assert main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "x"]) == 2
    assert "tokenizer.json is missing" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "--model" in (err := capsys.readouterr().err) and "no such directory" in err
    assert main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "x", "--top-p", "0"]) == 2
    assert "--top-p" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "x", "--max-tokens", "-1"]) == 2
    assert "--max-tokens" in capsys.readouterr().err


def test_generate_command_finds_a_runs_export_and_states_the_context_limit(tmp_path, small_config, tokenizer,
                                                                             capsys):
    """`--model RUN_DIR` reads the run's hf/ export; `--max-tokens` beyond the context is an error that says how
    many tokens fit."""
    model = HybridLM(small_config(vocab_size=640, max_position_embeddings=64)).eval()
    save_pretrained(model, tmp_path / "run" / "hf")
    tokenizer.save(tmp_path / "run" / "hf")
    prompt = "def generate(model"
    args = ["generate", "--prompt", prompt, "--temperature", "0", "--no-speculative"]
    assert main(args + ["--model", str(tmp_path / "run"), "--max-tokens", "5"]) == 0
    from_run = capsys.readouterr().out
    assert main(args + ["--model", str(tmp_path / "run" / "hf"), "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out == from_run
    room = 64 - len(tokenizer.encode(prompt))
    assert main(args + ["--model", str(tmp_path / "run"), "--max-tokens", str(room)]) == 0
    capsys.readouterr()
    assert main(args + ["--model", str(tmp_path / "run"), "--max-tokens", str(room + 1)]) == 2
    err = capsys.readouterr().err
    assert f"--max-tokens {room + 1}" in err and "context is 64" in err and f"at most {room} tokens" in err
    (tmp_path / "empty").mkdir()
    assert main(args + ["--model", str(tmp_path / "empty")]) == 2
    assert "expected config.json there, or in" in capsys.readouterr().err


def test_generate_command_compiled_reports_the_compile_it_spent(tmp_path, small_config, tokenizer, capsys):
    """`--compile` (speculative decoding off unless asked) prints the plain greedy text, and the summary reports
    the seconds the compile took (a warm-up before the timed tokens): most of what the command spent beyond an
    uncompiled run, not the 0.00 s of timing a step that had compiled before its first token was seen."""
    model = HybridLM(small_config(vocab_size=640)).eval()
    save_pretrained(model, tmp_path / "ckpt")
    tokenizer.save(tmp_path / "ckpt")
    args = ["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "def generate_tokens(model", "--max-tokens", "9",
            "--temperature", "0"]
    start = time.perf_counter()
    assert main(args + ["--no-speculative"]) == 0
    plain_seconds = time.perf_counter() - start
    plain = capsys.readouterr()
    start = time.perf_counter()
    assert main(args + ["--compile"]) == 0
    compiled_seconds = time.perf_counter() - start
    compiled = capsys.readouterr()
    assert compiled.out == plain.out and "mean acceptance length" not in compiled.err
    assert "compiling the decode step" in compiled.err and "tokens/s (steady state)" in compiled.err
    reported = float(re.search(r"decode step compiled in ([0-9.]+)s before them", compiled.err).group(1))
    assert 0.2 < reported <= compiled_seconds, compiled.err
    assert reported > 0.5 * (compiled_seconds - plain_seconds), (reported, compiled_seconds, plain_seconds)


def test_the_summary_says_what_decoding_did():
    """No speculative decoding, or no step drafted: "plain decode", never "draft length 0"; "did not pay" only where
    the controller measured it and turned drafting off; the draft lengths are those the verification steps used."""
    def stats(lengths, accepted, **flags):
        return AcceptanceStats(draft_length=max(lengths, default=0), steps=sum(lengths.values()), accepted=accepted,
                               draft_lengths=lengths, **flags)

    assert summary(10, 0.5, None, None) == "[10 tokens in 0.50s, 20.0 tokens/s; plain decode]"
    assert summary(0, 0.5, None, stats({}, 0, adaptive=True)).endswith("; no decode step, nothing drafted]")
    assert summary(10, 0.5, None, stats({}, 0, adaptive=True)).endswith("; plain decode, no step drafted]")
    off = summary(10, 0.5, None, stats({}, 0, adaptive=True, drafting_off=True))
    assert off.endswith("plain decode, no step drafted (drafting off: it did not pay at the measured acceptance "
                        "and step times)]")
    assert summary(10, 0.5, None, stats({3: 4}, 6)).endswith(
        "; speculative, draft length 3: mean acceptance length 2.50 over 4 verification steps, 6 of 12 drafts "
        "accepted]")
    # an adaptive run that drafted at k = 1..3, then stopped: the acceptance is over all those steps
    adapted = summary(64, 2.0, None, stats({1: 5, 2: 10, 3: 11}, 35, adaptive=True, drafting_off=True))
    assert "; speculative, draft lengths 1..3 (adapted to the measured acceptance and step times: they vary run to " \
           "run): mean acceptance length 2.35 over 26 verification steps, 35 of 58 drafts accepted; then drafting " \
           "off: it did not pay" in adapted
    compiled = summary(10, 0.5, 12.25, None)
    assert "20.0 tokens/s (steady state); decode step compiled in 12.25s before them; plain decode]" in compiled


def test_generate_command_summary_matches_what_was_measured(tmp_path, small_config, tokenizer, capsys):
    """The summary of a real adaptive run never shows a mean acceptance length above the longest draft length
    used + 1, and `--max-tokens 0` says nothing was drafted (no "did not pay": nothing was measured)."""
    model = HybridLM(small_config(vocab_size=640, max_position_embeddings=96)).eval()
    save_pretrained(model, tmp_path / "ckpt")
    tokenizer.save(tmp_path / "ckpt")
    args = ["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "def generate_tokens(model", "--seed", "0"]
    assert main(args + ["--max-tokens", "0"]) == 0
    err = capsys.readouterr().err
    assert "[0 tokens in" in err and "no decode step, nothing drafted]" in err and "did not pay" not in err
    assert main(args + ["--max-tokens", "40"]) == 0
    err = capsys.readouterr().err
    found = re.search(r"draft lengths? (\d+)(?:\.\.(\d+))?.*mean acceptance length ([0-9.]+) over (\d+) verif", err)
    assert found, err
    low, high, mean = int(found[1]), int(found[2] or found[1]), float(found[3])
    assert 1 <= low <= high and 1.0 <= mean <= high + 1, err
    assert "adapted to the measured acceptance and step times" in err


# ---------------------------------------------------------------------------------------------------- engine
@pytest.fixture
def checkpoint(tmp_path, small_config, tokenizer):
    config = small_config(vocab_size=640, max_position_embeddings=64)
    torch.manual_seed(0)
    model = HybridLM(config).eval()
    save_pretrained(model, tmp_path / "ckpt")
    tokenizer.save(tmp_path / "ckpt")
    return tmp_path / "ckpt", model


def test_engine_streams_what_generate_emits(checkpoint, tokenizer):
    from hybridtron.infer.engine import load_engine

    directory, model = checkpoint
    prompt = tokenizer.encode("def generate_tokens(model")
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = generate_tokens(model, [prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(2, 4)))[0]
    if expected[-1] in (2, 4):
        expected = expected[:-1]  # an end token ends the stream and is not yielded
    for speculative in (False, True):
        engine = load_engine(directory, speculative=speculative, draft_length=2)
        assert (engine.model_name, engine.max_context, engine.vocab_size) == ("ckpt", 64, 640)
        assert engine.speculative == speculative
        assert list(engine.stream(prompt, params)) == expected
        pairs = list(engine.stream_text(prompt, params))  # the text layer over this engine
        assert "".join(delta for _, delta in pairs) == tokenizer.decode(expected)
    stats = engine.last_stats  # a fixed k = 2 (shorter where fewer tokens remain), never the controller's
    assert stats.steps == sum(stats.draft_lengths.values()) > 0 and set(stats.draft_lengths) <= {1, 2}
    assert stats.mean_acceptance_length <= max(stats.draft_lengths) + 1
    assert not stats.adaptive and not stats.drafting_off


def test_engine_chat_template_and_end_tokens(checkpoint):
    from hybridtron.infer.engine import load_engine

    directory, _ = checkpoint
    engine = load_engine(directory)
    text = engine.chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = engine.encode(text)
    assert ids.count(engine.tokenizer.token_id("<|im_start|>")) == 3
    assert engine.end_token_ids == (2, 4)
    with pytest.raises(ValueError, match="at least one message"):
        engine.chat_template([])


def test_engine_without_mtp_decodes_plainly(tmp_path, small_config, tokenizer):
    from hybridtron.infer.engine import load_engine

    save_pretrained(HybridLM(small_config(vocab_size=640, num_nextn_predict_layers=0)), tmp_path / "plain")
    tokenizer.save(tmp_path / "plain")
    engine = load_engine(tmp_path / "plain")  # speculative by default, but there is no MTP block to draft with
    assert not engine.speculative
    assert len(list(engine.stream([5, 6], SamplingParams(temperature=0, max_tokens=3)))) <= 3


def test_engine_rejects_a_bad_draft_length(checkpoint):
    from hybridtron.infer.engine import load_engine

    with pytest.raises(ValueError, match="draft_length"):
        load_engine(checkpoint[0], draft_length=0)


def test_engine_rejects_a_tokenizer_larger_than_the_model(tmp_path, small_config, tokenizer):
    from hybridtron.infer.engine import load_engine

    save_pretrained(HybridLM(small_config(vocab_size=128)), tmp_path / "small")
    tokenizer.save(tmp_path / "small")
    with pytest.raises(ValueError, match="vocab_size is 128"):
        load_engine(tmp_path / "small")
