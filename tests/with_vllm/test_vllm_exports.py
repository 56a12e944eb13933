"""Every checkpoint hybridtron writes loads in vLLM as it is, and vLLM computes the model hybridtron computes.

The checkpoints: a pretraining run's export (RUN/hf), an SFT run's export (the chat template and its special
tokens), a `slice` of the first and a `quantize --format fp8` of it, all of the `tiny-dense` preset (Mamba-2,
attention and MLP layers, an attention-only MTP block: what vLLM's CPU backend runs). vLLM runs in its own
environment (.venv-vllm, scripts/setup_vllm.sh; the suite's .venv cannot import it), so the vLLM side is a
subprocess (vllm_driver.py) that starts one engine per checkpoint, in one process, and writes what it computed;
the tests compare that with hybridtron's own forward. With tensor_parallel_size=2 (a second driver run) vLLM gives
what one rank gives.

CI runs these (scripts/test.sh installs .venv-vllm first); without the environment they fail, naming the fix.
HYBRIDTRON_NO_VLLM=1 skips them, for a machine that should not install vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.cli import main as cli_main
from hybridtron.config import NEMOTRON_H, ModelConfig
from hybridtron.data.chat import load_chat_tokenizer, tokenize_chat
from hybridtron.deploy.quantize import quantize_checkpoint
from hybridtron.deploy.slice import slice_checkpoint
from hybridtron.post.rl.engines.vllm import vllm_python

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("vllm_driver.py")
TEXTS = ["import json\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n",
         "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"]
CHATS = [[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 3?"}],
         [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
          {"role": "user", "content": "And 4 * 5?"}]]
GREEDY_TOKENS = 8
LOGPROB_TOLERANCE = 1e-4  # fp32 on both sides
# vLLM runs a ModelOpt checkpoint in bf16 or fp16 only ("torch.float32 is not supported for quantization method
# modelopt"): its bf16 forward on the FP8 weights against our fp32 forward on the same weights, dequantized (worst
# difference measured 0.033 nats; the greedy tokens are equal)
DTYPES = {"fp8": "bfloat16"}
TOLERANCES = {"fp8": 0.1}
# vLLM's CPU engine: a small KV cache (GiB), and the engine in the driver's own process (no engine-core process to
# spawn and import vLLM again: about 20 s less per run)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# two ranks on two cores: vLLM's automatic binding keeps a core free for the front end and finds none for rank 1
TP2_ENV = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.fixture(scope="module")
def python() -> Path:
    if os.environ.get("HYBRIDTRON_NO_VLLM"):
        pytest.skip("HYBRIDTRON_NO_VLLM is set: vLLM is not installed here")
    found = vllm_python()
    if not found.exists():
        pytest.fail(f"no vLLM environment at {found}: run ./scripts/setup_vllm.sh (scripts/test.sh does), or set "
                    f"HYBRIDTRON_NO_VLLM=1 to skip the vLLM tests", pytrace=False)
    return found


@pytest.fixture(scope="module")
def checkpoints(trained_dense_run, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    base = trained_dense_run / "hf"
    assert cli_main(["sft", "--model", str(base), "--data", "env:math", "--out", str(root / "sft"), "--steps", "2",
                     "--set", "sft.env_examples=32", "--set", "sft.env_levels=1", "--set", "sft.seq_len=256",
                     "--set", "sft.batch_size=2",
                     "--set", "sft.val_batches=1", "--set", "train.checkpoint_every=1000", "--quiet"]) == 0
    slice_checkpoint(base, root / "slice", layers=4)
    quantize_checkpoint(base, root / "fp8", "fp8", calib=2)
    return {"pretrain": base, "sft": root / "sft" / "hf", "slice": root / "slice", "fp8": root / "fp8"}


def prompts(directory: Path) -> list[list[int]]:
    tokenizer = load_chat_tokenizer(directory)
    return [[tokenizer.bos_id] + tokenizer.encode(text) for text in TEXTS]


def run_driver(python: Path, jobs: list[dict], workdir: Path, env: dict[str, str]) -> dict:
    (workdir / "jobs.json").write_text(json.dumps(jobs))
    log = workdir / "vllm.log"
    with open(log, "w") as out:
        done = subprocess.run([str(python), str(DRIVER), str(workdir / "jobs.json"), str(workdir / "out.json")],
                              stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, timeout=600)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        pytest.fail(f"the vLLM driver exited {done.returncode}; the end of {log}:\n{tail}", pytrace=False)
    return json.loads((workdir / "out.json").read_text())


@pytest.fixture(scope="module")
def served(python, checkpoints, tmp_path_factory) -> dict[str, dict]:
    """What vLLM computed on each checkpoint: one driver run, one engine per checkpoint."""
    jobs = [{"name": name, "model": str(directory), "dtype": DTYPES.get(name, "float32"), "prompts": prompts(directory),
             "greedy_tokens": GREEDY_TOKENS, "texts": TEXTS, "chats": CHATS} for name, directory in checkpoints.items()]
    return run_driver(python, jobs, tmp_path_factory.mktemp("vllm"), VLLM_ENV)


def reference(directory: Path, prompt_ids: list[list[int]]) -> tuple[list[list[float]], list[list[int]]]:
    """hybridtron's log-probs of each prompt's tokens and its greedy continuation (full forwards, fp32)."""
    model = load_pretrained(directory, dtype=torch.float32).eval()
    logprobs, greedy = [], []
    with torch.no_grad():
        for ids in prompt_ids:
            lp = torch.log_softmax(model(torch.tensor([ids]), mtp=False).logits[0].float(), -1)
            logprobs.append(lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist())
            sequence = list(ids)
            for _ in range(GREEDY_TOKENS):
                sequence.append(int(model(torch.tensor([sequence]), mtp=False).logits[0, -1].argmax()))
            greedy.append(sequence[len(ids):])
    return logprobs, greedy


@pytest.mark.parametrize("name", ["pretrain", "sft", "slice", "fp8"])
def test_vllm_computes_hybridtrons_model(name, checkpoints, served):
    directory = checkpoints[name]
    assert json.loads((directory / "config.json").read_text())["model_type"] == NEMOTRON_H
    logprobs, greedy = reference(directory, prompts(directory))
    got = served[name]
    worst = max(abs(a - b) for ours, theirs in zip(logprobs, got["prompt_logprobs"]) for a, b in zip(ours, theirs))
    assert worst < TOLERANCES.get(name, LOGPROB_TOLERANCE), worst
    assert got["greedy"] == greedy


def test_a_slice_and_the_fp8_export_are_what_they_claim(checkpoints):
    assert ModelConfig.from_hf(checkpoints["slice"]).num_hidden_layers == 4
    quant = json.loads((checkpoints["fp8"] / "hf_quant_config.json").read_text())
    assert quant["quantization"]["quant_algo"] == "FP8"


@pytest.mark.parametrize("name", ["pretrain", "sft", "slice", "fp8"])
def test_vllm_encodes_text_after_the_bos_the_model_was_trained_with(name, checkpoints, served):
    tokenizer = load_chat_tokenizer(checkpoints[name])
    assert served[name]["text_ids"] == [[tokenizer.bos_id] + tokenizer.encode(text) for text in TEXTS]


def test_vllm_renders_hybridtrons_chat_template(checkpoints, served):
    tokenizer = load_chat_tokenizer(checkpoints["sft"], require_template=True)
    ours = [tokenize_chat(tokenizer, messages, add_generation_prompt=True).ids.tolist() for messages in CHATS]
    assert served["sft"]["chat_ids"] == ours  # one bos: the template's, the chat encoded without special tokens


def test_tensor_parallel_2_equals_one_rank(python, checkpoints, served, tmp_path):
    directory = checkpoints["pretrain"]
    job = {"name": "tp2", "model": str(directory), "tensor_parallel_size": 2, "prompts": prompts(directory),
           "greedy_tokens": GREEDY_TOKENS}
    tp2, tp1 = run_driver(python, [job], tmp_path, TP2_ENV)["tp2"], served["pretrain"]
    assert tp2["greedy"] == tp1["greedy"]
    rows = zip(tp1["prompt_logprobs"] + tp1["greedy_logprobs"], tp2["prompt_logprobs"] + tp2["greedy_logprobs"])
    for one, two in rows:
        assert max(abs(a - b) for a, b in zip(one, two)) < LOGPROB_TOLERANCE
