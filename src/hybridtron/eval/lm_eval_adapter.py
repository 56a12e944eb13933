"""hybridtron as an lm-evaluation-harness model: `--model hybridtron` (lm_eval 0.4, the `eval` extra).

    python -m hybridtron.eval.lm_eval_adapter --model hybridtron --model_args pretrained=runs/quickstart/hf \\
        --tasks lambada_openai --device cpu --batch_size 8

    import lm_eval
    import hybridtron.eval.lm_eval_adapter  # noqa: F401 (registers the model "hybridtron")
    lm_eval.simple_evaluate(model="hybridtron", model_args="pretrained=DIR", tasks=["hellaswag"], device="cpu")

How lm_eval finds it: lm_eval 0.4 looks a `--model` name up in its registry (`lm_eval.api.registry`), which holds
its own models (`lm_eval.models.MODEL_MAPPING`) and whatever the running process registered with
`register_model`; it reads no plugin entry points for models, and `--include_path` adds tasks, not models (its
task files' `!function` hooks are imported only after the model is built). So the model must be registered in the
process that runs lm_eval: importing this module does that, and running it (`python -m
hybridtron.eval.lm_eval_adapter ARGS`) runs lm_eval's own command line with ARGS after registering (every option
and subcommand of `lm_eval` / `lm-eval`: `run`, `ls tasks`, `--include_path`, ...). The plain `lm_eval` command
cannot load it.

Model arguments (`--model_args key=value,...`): `pretrained` (required: a `nemotron_h` checkpoint directory, ours or
one transformers wrote, with its tokenizer.json; or a run directory, whose export is `hf/`), `dtype` (float32 (the
default), bfloat16, float16, or auto: the checkpoint's own), `max_length` (tokens of context; default the model's
max_position_embeddings), `max_gen_toks` (default 256), `speculative` (draft with the MTP block; default true:
greedy output is plain decoding's), `add_bos_token` (default true: the model was trained on `bos text eos`
documents), `enable_thinking` (the chat template's thinking switch; default unset), `seed` (of sampled generation;
default 0), `progress` (a progress line with an estimate on stderr for each kind of request, as `hybridtron eval`
prints; default true). `--batch_size` is the rows of one scoring forward and the sequences decoded at once ("auto"
is `AUTO_BATCH_SIZE`: no probing); `--device` cpu, cuda or cuda:N (cuda where none is: the CPU, with a warning).

The requests:
- `loglikelihood` (context, continuation): one forward over the context and continuation (left-truncated to
  max_length + 1 tokens, as lm_eval's HF model does), no MTP, lm_head applied to the continuation's positions only;
  the sum of log_softmax (fp32) of the continuation's tokens, and whether each is the argmax. Requests are batched
  longest first, right-padded (every layer is causal, so padding changes no real position).
- `loglikelihood_rolling` (text): lm_eval's disjoint rolling windows of max_length tokens, each scored as above,
  summed; the first token is conditioned on bos.
- `generate_until` (context, gen_kwargs): through the inference engine (`hybridtron.infer.engine.HybridEngine`):
  greedy unless the task sets do_sample with a temperature, ending at `until`'s stop strings (cut from the text),
  the model's end tokens, or `max_gen_toks`; the context is left-truncated to leave room for those. Special tokens
  other than the end token stay in the text (a `<think>` block is for the task's filters to strip).
- the chat template (`--apply_chat_template`) only when asked: hybridtron's (`hybridtron.data.chat`), which the
  checkpoint must declare (a base model has none: refused).
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Sequence

import torch

from hybridtron.checkpoint.hf import resolve_checkpoint_dir
from hybridtron.data.chat import CHAT_TEMPLATE, load_chat_tokenizer, render_chat, token_text
from hybridtron.data.tokenizer import IM_END
from hybridtron.eval.options import check_device
from hybridtron.eval.positions import load_model_and_tokenizer
from hybridtron.eval.progress import Progress
from hybridtron.infer.engine import HybridEngine
from hybridtron.infer.fastpath import lay_out_for_decoding
from hybridtron.infer.sampling import SamplingParams

try:  # optional dependency (the `eval` extra): lm-evaluation-harness, which this module plugs into
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import model_registry
    from lm_eval.models.utils import normalize_gen_kwargs
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as error:
    raise ImportError(f"hybridtron.eval.lm_eval_adapter needs lm-evaluation-harness 0.4 ({error}); install it with "
                      f"pip install 'hybridtron[eval]'") from None

MODEL_NAME = "hybridtron"
AUTO_BATCH_SIZE = 16  # what --batch_size auto means here: the adapter does not probe for the largest that fits
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": None}

logger = logging.getLogger(__name__)


def batch_rows(batch_size: int | str | None, max_batch_size: int | None) -> int:
    """lm_eval's --batch_size (an int, "N", "auto" or "auto:N") capped by --max_batch_size, as rows."""
    text = str(batch_size if batch_size is not None else 1)
    if text.startswith("auto"):
        rows = AUTO_BATCH_SIZE
    elif text.isdigit() and int(text) >= 1:
        rows = int(text)
    else:
        raise ValueError(f"batch_size: expected a positive integer or auto, got {batch_size!r}")
    return min(rows, max_batch_size) if max_batch_size else rows


def resolve_device(device: str | None) -> torch.device:
    """lm_eval's --device (its default is cuda:0): cpu, cuda or cuda:N (ValueError otherwise); the CPU where CUDA is
    asked for but absent."""
    if device is None:
        return torch.device("cpu")
    device = check_device(device, "device")
    if device.type == "cuda" and not torch.cuda.is_available():
        logger.warning("%s: device %s asked for, but CUDA is not available; running on the CPU", MODEL_NAME, device)
        return torch.device("cpu")
    return device


class HybridtronLM(TemplateLM):
    """An lm_eval model over a hybridtron checkpoint (module docstring): the model's forward scores, the engine
    generates."""

    def __init__(self, pretrained: str | None = None, *, dtype: str = "float32", device: str | None = None,
                 batch_size: int | str | None = 1, max_batch_size: int | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, speculative: bool = True, add_bos_token: bool = True,
                 enable_thinking: bool | None = None, seed: int = 0, progress: bool = True):
        super().__init__()
        if pretrained is None:
            raise ValueError(f"{MODEL_NAME}: model_args needs pretrained=DIR, a nemotron_h checkpoint directory with "
                             f"its tokenizer.json")
        if dtype not in DTYPES:
            raise ValueError(f"{MODEL_NAME}: dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
        self.directory, self.model_name = resolve_checkpoint_dir(pretrained, "pretrained")
        self._device = resolve_device(device)
        model, self.tokenizer = load_model_and_tokenizer(self.directory, dtype=DTYPES[dtype], device=self._device)
        lay_out_for_decoding(model)  # the engine owns this model: its weights are laid out for decode steps
        self.batch_size = batch_rows(batch_size, max_batch_size)
        # the engine checks max_length against the model's max_position_embeddings
        self.engine = HybridEngine(model, self.tokenizer, model_name=self.model_name, speculative=speculative,
                                   max_context=max_length, max_slots=self.batch_size)
        self.model, self.max_length = model, self.engine.max_context
        self.max_gen_toks, self.add_bos_token = max_gen_toks, add_bos_token
        self.enable_thinking, self.seed, self.progress = enable_thinking, seed, progress

    # ------------------------------------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and a rolling text's first window are conditioned on: bos, which starts every
        document the model was trained on."""
        return self.tokenizer.bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **unused) -> list[int]:
        """The text's ids, after bos (with add_bos_token) unless `add_special_tokens` is False; with None (lm_eval's
        default) a text that starts with bos already (a chat-templated prompt) gets no second one."""
        ids = self.tokenizer.encode(string)
        bos = self.tokenizer.bos_id
        add_bos = self.add_bos_token and add_special_tokens is not False
        if add_bos and not (add_special_tokens is None and ids[:1] == [bos]):
            ids = [bos, *ids]
        return ids

    @property
    def tokenizer_name(self) -> str:
        """Keys lm_eval's request cache for chat-templated prompts."""
        return f"{self.model_name}-{self.tokenizer.fingerprint}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template lm_eval records in its results (and asks for before any request): hybridtron's, which the
        checkpoint must declare; ValueError for a base model (no template) or a foreign one."""
        if chat_template is False or chat_template is None:
            return None
        load_chat_tokenizer(self.directory, vocab_size=self.model.config.vocab_size, require_template=True)
        return CHAT_TEMPLATE

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation's prompt text in hybridtron's chat format; without the generation prompt the last
        (assistant) turn is left open, to be continued (transformers' continue_final_message)."""
        text = render_chat(chat_history, add_generation_prompt=add_generation_prompt,
                           enable_thinking=self.enable_thinking if add_generation_prompt else None,
                           bos_token=token_text(self.tokenizer, self.tokenizer.bos_id)).text
        if not add_generation_prompt and chat_history and chat_history[-1].get("role") == "assistant":
            text = text.removesuffix(f"{IM_END}\n")
        return text

    # ------------------------------------------------------------------------------------------ scoring
    @torch.inference_mode()
    def score_batch(self, batch: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log p(targets | inputs), whether each target is the argmax) of (input ids, target ids) rows, the
        targets being the next tokens of the inputs' last positions; one right-padded forward."""
        longest = max(len(inputs) for inputs, _ in batch)
        ids = torch.full((len(batch), longest), self.tokenizer.pad_id, dtype=torch.long)
        for row, (inputs, _) in enumerate(batch):
            ids[row, :len(inputs)] = torch.tensor(inputs)
        hidden_BTD = self.model(ids.to(self._device), logits=False, mtp=False).hidden
        results = []
        for row, (inputs, targets) in enumerate(batch):
            # lm_head on the scored positions only: a long context's [T, vocab] logits are never formed
            logprobs_NV = self.model.lm_head(hidden_BTD[row, len(inputs) - len(targets):len(inputs)]).float() \
                .log_softmax(dim=-1)
            targets_N = torch.tensor(targets, device=logprobs_NV.device)
            total = logprobs_NV.gather(1, targets_N[:, None]).sum()
            results.append((float(total), bool((logprobs_NV.argmax(dim=-1) == targets_N).all())))
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, unit: str = "loglikelihood requests",
                              **unused) -> list[tuple[float, bool]]:
        """lm_eval's tokenized requests ((context, continuation) or None, context ids, continuation ids) ->
        (log-likelihood of the continuation, greedy), in order; `unit` names them on the progress line."""
        rows = []
        for _, context_ids, continuation_ids in requests:
            if len(continuation_ids) > self.max_length:
                raise ValueError(f"{MODEL_NAME}: a continuation of {len(continuation_ids)} tokens is longer than "
                                 f"max_length {self.max_length}")
            ids = (context_ids + continuation_ids)[-(self.max_length + 1):]
            rows.append((ids[:-1], continuation_ids))
        results: list[tuple[float, bool]] = [(0.0, True)] * len(rows)  # an empty continuation: log 1, greedy
        scored = sorted((i for i, (_, targets) in enumerate(rows) if targets), key=lambda i: -len(rows[i][0]))
        # a row's forward costs about its length (a batch's, its longest's, padded): the estimate weighs them so
        line = Progress("eval harness", len(scored), unit, work=sum(len(rows[i][0]) for i in scored),
                        enabled=self.progress and not disable_tqdm and bool(scored))
        for start in range(0, len(scored), self.batch_size):  # longest first: a batch's rows pad little
            indices = scored[start:start + self.batch_size]
            for index, result in zip(indices, self.score_batch([rows[i] for i in indices])):
                results[index] = result
            line.advance(len(indices), work=sum(len(rows[i][0]) for i in indices))
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each text, over lm_eval's disjoint windows of max_length tokens."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context_ids, target_ids in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text, add_special_tokens=False), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context_ids, target_ids))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (loglikelihood, _) in zip(owners, self._loglikelihood_tokens(
                windows, disable_tqdm, unit="loglikelihood_rolling windows")):
            totals[owner] += loglikelihood
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # --------------------------------------------------------------------------------------- generation
    def sampling_params(self, gen_kwargs: dict) -> SamplingParams:
        """A task's generation kwargs as the engine's: greedy unless do_sample (with temperature, top_k, top_p),
        `until` as stop strings, max_gen_toks as max_tokens; others are not the engine's, and are ignored."""
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        stop = tuple(s for s in kwargs.pop("until") if s)
        max_tokens = kwargs.pop("max_gen_toks")
        sampled = kwargs.pop("do_sample")
        temperature, top_k, top_p = (kwargs.pop(name, default) for name, default in
                                     (("temperature", 0.0), ("top_k", None), ("top_p", None)))
        if kwargs:
            logger.warning("%s: generation kwargs %s are not the engine's; ignored", MODEL_NAME, sorted(kwargs))
        if not 1 <= max_tokens < self.max_length:
            raise ValueError(f"{MODEL_NAME}: max_gen_toks {max_tokens} must lie in [1, max_length "
                             f"{self.max_length}) (the context needs a token)")
        return SamplingParams(temperature=temperature if sampled else 0.0, top_k=top_k or 0,
                              top_p=1.0 if top_p is None else top_p, seed=self.seed, max_tokens=max_tokens, stop=stop)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation through the engine (the requests sharing their generation kwargs decode
        together, `batch_size` at a time), cut at the first stop string."""
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        outputs = [""] * len(requests)
        line = Progress("eval harness", len(requests), "generate_until requests",
                        enabled=self.progress and not disable_tqdm and bool(requests))
        for group in groups.values():
            params = self.sampling_params(requests[group[0]].args[1])
            room = self.max_length - params.max_tokens  # the context keeps its last tokens (lm_eval's HF model's)
            prompts = [self.tok_encode(requests[i].args[0])[-room:] for i in group]
            completions = []
            for start in range(0, len(prompts), self.batch_size):  # first_prompt: sampled as one call would
                completions += self.engine.generate(prompts[start:start + self.batch_size], params, logprobs=False,
                                                    first_prompt=start)
                line.advance(len(completions) - start)
            for index, [completion] in zip(group, completions):
                tokens = completion.token_ids
                if tokens and tokens[-1] in self.engine.end_token_ids:
                    tokens = tokens[:-1]
                text = self.tokenizer.decode(tokens)
                for stop in params.stop:
                    text = text.split(stop)[0]
                outputs[index] = text
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
        return outputs


# registered once per process (a second registration of another class object under the name is an error in
# lm_eval's registry, and `python -m` runs this file as __main__, apart from any later import of it)
if MODEL_NAME not in model_registry:
    model_registry.register(MODEL_NAME)(HybridtronLM)


def main(argv: Sequence[str] | None = None) -> None:
    """lm_eval's command line with the model registered: `python -m hybridtron.eval.lm_eval_adapter ARGS` is
    `lm_eval ARGS` that knows `--model hybridtron`."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
