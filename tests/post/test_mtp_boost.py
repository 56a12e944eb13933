"""MTP boosting: the parallel self-conditioned chain equals the drafter's cached path; `hybridtron mtp-boost` on the
one Trainer lowers the KL and raises acceptance, trains the MTP block alone, resumes an interrupted run bit for bit,
and its --print-config round-trips through --config."""

import json
import os
import signal

import pytest
import torch

from hybridtron.checkpoint import load_pretrained, save_pretrained
from hybridtron.cli import main
from hybridtron.data.chat import save_tokenizer_files
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.model.lm import HybridLM
from hybridtron.post.mtp_boost.training import PoolBatches, boost_loss, mtp_chain, mtp_chain_ref

FP32 = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides", [{}, dict(mtp_layers_block_type="*-*E")])
def test_chain_matches_the_drafters_cached_path_forward_and_backward(small_config, overrides):
    """Every anchor and depth whose input token exists; gradients of the MTP block's weights too. A block of
    attention, MLP, attention, MoE checks that each attention layer keeps its own chain keys."""
    config = small_config(vocab_size=32, **overrides)
    model = HybridLM(config).eval()
    ids = torch.randint(0, 32, (2, 10))
    with torch.no_grad():
        hidden0 = model(ids, mtp=False).hidden
    depths = 4
    weights = [torch.randn(2, 10, config.hidden_size) for _ in range(depths)]

    def run(fn):
        model.zero_grad()
        outputs = fn(model, ids, hidden0, depths)
        valid = [out[:, :10 - depth] for depth, out in enumerate(outputs, start=1)]
        loss = sum((v * w[:, :v.shape[1]]).sum() for v, w in zip(valid, weights))
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.mtp.named_parameters() if p.grad is not None}
        return [v.detach() for v in valid], grads

    fast_out, fast_grads = run(mtp_chain)
    ref_out, ref_grads = run(mtp_chain_ref)
    for fast, ref in zip(fast_out, ref_out):
        torch.testing.assert_close(fast, ref, **FP32)
    assert fast_grads.keys() == ref_grads.keys() and len(fast_grads) > 5
    for name in fast_grads:  # fp32 sums in different orders: an error budget relative to the gradient's scale
        scale = float(ref_grads[name].abs().max())
        torch.testing.assert_close(fast_grads[name], ref_grads[name], rtol=1e-4, atol=1e-5 * max(scale, 1.0),
                                   msg=lambda m: f"{name}: {m}")


def test_depth_one_is_the_training_forwards_mtp(small_config):
    model = HybridLM(small_config(vocab_size=32)).eval()
    ids = torch.randint(0, 32, (2, 9))
    with torch.no_grad():
        out = model(ids)
        chain = mtp_chain(model, ids, out.hidden, 2)
    torch.testing.assert_close(model.lm_head(chain[0])[:, :-1], out.mtp_logits[0][:, :-1], **FP32)


def test_boost_loss_is_the_scaled_forward_kl(small_config):
    model = HybridLM(small_config(vocab_size=32)).eval()
    ids = torch.randint(0, 32, (1, 6))
    with torch.no_grad():
        out = model(ids, mtp=False)
        loss, per_depth = boost_loss(model, ids, out.hidden, out.logits, depths=2, temperature=2.0)
        student = model.lm_head(mtp_chain(model, ids, out.hidden, 2)[1])[0, :4] / 2
        teacher = out.logits[0, 2:] / 2
    p, log_p, log_q = teacher.softmax(-1), teacher.log_softmax(-1), student.log_softmax(-1)
    expected = 4 * (p * (log_p - log_q)).sum(-1).mean()
    assert float(per_depth[1]) == pytest.approx(float(expected), rel=1e-5)
    assert float(loss) == pytest.approx(float(sum(per_depth)) / 2, rel=1e-6)


# ------------------------------------------------------------------------------------------------ the command
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, small_config):
    """A random model of a 32-token vocabulary, where 40 steps visibly raise acceptance, and a tokenizer (which the
    export carries; sampling from bos alone, the model never meets a token past its 32)."""
    directory = tmp_path_factory.mktemp("mtp_boost") / "ckpt"
    torch.manual_seed(0)
    save_pretrained(HybridLM(small_config(vocab_size=32)), directory)
    Tokenizer.train(["def f(x):\n    return x + 1\n" * 50], 600).save(directory)
    return directory


def boost(checkpoint, out, *args) -> int:
    return main(["mtp-boost", "--model", str(checkpoint), "--out", str(out), "--quiet", *args])


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


SMALL = ["--set", "boost.num_samples=8", "--set", "boost.sample_length=8", "--set", "boost.depths=3",
         "--set", "boost.draft_length=3", "--set", "boost.eval_tokens=8"]


def test_boosting_lowers_the_kl_raises_acceptance_and_trains_the_mtp_block_alone(checkpoint, tmp_path, capsys):
    """40 steps on 64 on-policy samples. Measured (seed 0): KL 0.0126 -> 0.0057 (mean of the first and last 5
    steps), greedy acceptance length at draft 4 1.03 -> 1.28; the backbone, embeddings, lm_head and router biases
    stay bit-identical."""
    out = tmp_path / "boosted"
    assert boost(checkpoint, out, "--steps", "40", "--set", "train.lr=3e-3", "--set", "boost.num_samples=64",
                 "--set", "boost.sample_length=24", "--set", "boost.depths=4", "--set", "boost.draft_length=4",
                 "--set", "boost.eval_tokens=32") == 0
    assert "mean acceptance length (greedy, draft length 4): " in capsys.readouterr().out
    record = json.loads((out / "mtp_boost.json").read_text())
    assert record["acceptance_after"] > record["acceptance_before"] + 0.15
    assert [step for step, _ in record["acceptance_by_step"]] == [0, 40] and record["boost"]["depths"] == 4
    steps = [line for line in metrics(out) if "loss" in line]
    assert len(steps) == 40 and all(f"mtp_loss_{d}" in line for line in steps for d in range(1, 5))
    losses = [line["loss"] for line in steps]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    assert (out / "hf" / "tokenizer.json").is_file() and (out / "hf" / "config.json").is_file()
    boosted, original = load_pretrained(out / "hf").state_dict(), load_pretrained(checkpoint).state_dict()
    assert boosted.keys() == original.keys()
    for name, tensor in original.items():
        if not name.startswith("mtp."):
            assert torch.equal(boosted[name], tensor), name
    assert not torch.equal(boosted["mtp.layers.0.eh_proj.weight"], original["mtp.layers.0.eh_proj.weight"])
    assert boost(checkpoint, out) == 0  # the same command again: complete, nothing changes
    assert "this run is complete (40 steps)" in capsys.readouterr().out


def test_an_interrupted_run_resumes_bit_for_bit(checkpoint, tmp_path, monkeypatch, capsys):
    """4 steps straight, against Ctrl-C during step 2 and --resume: the same rows, the same MTP weights."""
    assert boost(checkpoint, tmp_path / "whole", "--steps", "4", *SMALL) == 0
    draw_rows = PoolBatches.draw_rows

    def interrupt_in_step_2(self):
        rows = draw_rows(self)
        if self.steps_drawn == 2:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends; the step in flight finishes
        return rows

    monkeypatch.setattr(PoolBatches, "draw_rows", interrupt_in_step_2)
    cut = tmp_path / "cut"
    assert boost(checkpoint, cut, "--steps", "4", *SMALL) == 130
    assert f"hybridtron mtp-boost --out {cut} --resume" in capsys.readouterr().err
    assert not (cut / "hf").exists()
    monkeypatch.undo()
    assert main(["mtp-boost", "--out", str(cut), "--resume", "--quiet"]) == 0
    whole, resumed = load_pretrained(tmp_path / "whole" / "hf").state_dict(), load_pretrained(cut / "hf").state_dict()
    for name, tensor in whole.items():
        assert torch.equal(resumed[name], tensor), name
    after_the_cut = [[{key: value for key, value in line.items() if key != "tokens_per_s"}  # a timing
                      for line in metrics(run) if line["step"] > 2] for run in (tmp_path / "whole", cut)]
    assert after_the_cut[0] == after_the_cut[1] and len(after_the_cut[0]) == 2
    before_and_after = [json.loads((run / "mtp_boost.json").read_text())["acceptance_by_step"]
                        for run in (tmp_path / "whole", cut)]
    assert before_and_after[0] == before_and_after[1]


def test_print_config_round_trips_through_config_and_mistakes_are_one_line(checkpoint, tmp_path, capsys):
    given = ["--set", "boost.depths=3", "--set", "train.lr=1e-3", "--steps", "7"]
    assert main(["mtp-boost", "--model", str(checkpoint), "--print-config", *given]) == 0
    printed = capsys.readouterr().out
    assert "\n[boost]\n" in printed and "\ndepths = 3  # " in printed and "\n[model]" not in printed  # --model's
    (tmp_path / "boost.toml").write_text(printed)
    assert main(["mtp-boost", "--model", str(checkpoint), "--print-config", "--config", str(tmp_path / "boost.toml")]) \
        == 0
    assert capsys.readouterr().out == printed
    for setting, message in (("boost.depths=0", "boost.depths must be an integer >= 1, got 0"),
                             ("train.router_bias_rate=1e-3", "train.router_bias_rate must be 0 for mtp-boost"),
                             ("model.hidden_size=8", "[model] cannot be set here")):
        assert boost(checkpoint, tmp_path / "never", "--set", setting) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_mtp_boost_on_chat_and_text_prompts(tmp_path, small_config, capsys):
    """`--prompts FILE.jsonl`: conversations of different lengths, rendered with the chat template and the
    generation prompt (a closing assistant reply dropped), sampled from and measured on; a text file: a prompt a
    line. The export carries the model's tokenizer and chat template."""
    config = small_config(vocab_size=640)
    save_pretrained(HybridLM(config), tmp_path / "ckpt")
    save_tokenizer_files(Tokenizer.train(["What is 2 + 3? The answer is 5.\n" * 50], 600), tmp_path / "ckpt",
                         model_max_length=config.max_position_embeddings)
    lines = [{"messages": [{"role": "user", "content": "What is 2 + 3?"}]},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"},
                           {"role": "assistant", "content": "42"}]}]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "prompts.txt").write_text("What is 2 + 3?\nThe answer\n")
    settings = ["--steps", "2", "--set", "boost.num_samples=4", "--set", "boost.sample_length=6", "--set",
                "boost.depths=2", "--set", "boost.draft_length=2", "--set", "boost.eval_tokens=8"]
    for prompts in ("prompts.jsonl", "prompts.txt"):
        out = tmp_path / prompts.replace(".", "_")
        assert boost(tmp_path / "ckpt", out, "--prompts", str(tmp_path / prompts), *settings) == 0
        assert "mean acceptance length (greedy, draft length 2)" in capsys.readouterr().out
        assert "chat_template" in json.loads((out / "hf" / "tokenizer_config.json").read_text())
    (tmp_path / "bad.jsonl").write_text('{"messages": "hi"}\n')
    assert boost(tmp_path / "ckpt", tmp_path / "bad", "--prompts", str(tmp_path / "bad.jsonl")) == 2
    assert "bad.jsonl line 1" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
