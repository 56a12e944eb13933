"""The "vllm" rollout engine: vLLM generates the rollouts, in a process of its own.

vLLM lives in its own environment (`.venv-vllm`, made by scripts/setup_vllm.sh; `HYBRIDTRON_VLLM_PYTHON` names
another Python that imports vllm): its CPU build pins older transformers than hybridtron's. So the engine starts
that Python on hybridtron.post.rl.engines.vllm_worker (a script importing vLLM and nothing of hybridtron) and
speaks to it over a local `multiprocessing.connection`; whichever process runs the rollout role (the learner's,
inline; a role process; a Ray actor) owns that vLLM process, which dies with it. Its output goes to `vllm.log` in
the engine's scratch directory, named by every error.

What maps to what (vllm 0.32; the vLLM files named are under site-packages/vllm):
- sampling: the rollout's `SamplingParams` become vLLM's (temperature, top_k (0 = -1, off), top_p, max_tokens,
  stop strings, stop_token_ids plus the chat template's end tokens, which vLLM keeps in the sample's token ids as
  hybridtron's engine does), `n` samples of one prompt per request, seeded per prompt from the step's seed and the
  prompt's index in the round (the hybridtron engine's `first_prompt` rule: a replica's share samples what one
  engine would). vLLM's noise is its own, so the two engines draw different samples from the same distribution.
- log-probs: vLLM runs with `logprobs_mode="processed_logprobs"` (config/model.py): each token's log-prob under the
  temperature-scaled, top-k / top-p filtered and renormalised distribution it was drawn from, the definition of
  hybridtron's engine and of the learner's `sampled_logprobs` (the default, "raw_logprobs", is the unscaled
  log-softmax, which the TIS / IcePop weight would misread as a mismatch whenever T != 1 or a filter is on).
- weights: after every optimizer step the learner's state dict is written as safetensors (HF names, the experts
  split as an export stores them) into the scratch directory and vLLM reloads them in place,
  `collective_rpc("reload_weights", kwargs={"weights_path": DIR})` (v1/worker/gpu_worker.py, model_executor/
  model_loader/reload/inplace.py; 0.1-0.2 s for a small model), then labels them with the step
  (`LLMEngine.set_weight_version`, v1/engine/core.py). `weight_sync = "nccl"` (GPUs only, unverified here: written
  from vLLM's weight_transfer/nccl_engine.py, not run) uses vLLM's NCCL weight-transfer engine instead: the
  role broadcasts the tensors to the vLLM workers, which load them layer by layer.
- the version check: every generation names the version the role expects; vLLM refuses it unless it holds that
  version, and every sampled token comes back labelled with the version that drew it (`CompletionOutput.
  weight_versions`, outputs.py), checked again: a sample of another version is an error, never an off-policy sample.
- routing replay (R3): with MoE layers (GPUs only) vLLM returns each sample's routed experts
  (`enable_return_routed_experts`, config/aux_output.py; `CompletionOutput.routed_experts` [tokens, MoE layers,
  top-k] over prompt + completion), laid out as `Completion.expert_ids` ({backbone router name: [P + C - 1, K]}).
  Unverified here: no MoE model runs on vLLM's CPU backend.
- MTP speculative decoding: `speculative_config={"method": "mtp", "num_speculative_tokens": draft_length}`, where
  vLLM's nemotron_h MTP runs: GPUs, an MTP block of attention and MoE layers (model_executor/models/
  nemotron_h_mtp.py builds only those). On vLLM's CPU backend the engine starts and the first speculative step fails
  (v1/worker/mamba_utils.py's Mamba state copy for speculative steps is a Triton kernel, and the CPU build has no
  Triton backend), so it is refused up front (`vllm_blocker`).
- teacher scoring (MOPD): `score` gives the prompt log-probs of whole sequences with their top-k
  (`SamplingParams(prompt_logprobs=k)`): the model's plain log-softmax (prompt tokens skip the sampling processors),
  which is what the teacher's scores are at temperature 1 (`VLLMTeacherScores`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from multiprocessing.connection import Listener
from pathlib import Path

import torch

from hybridtron.checkpoint.hf import quantization_algo, to_disk_state, write_checkpoint
from hybridtron.config import MOE, ModelConfig
from hybridtron.data.tokenizer import EOS, IM_END
from hybridtron.distributed.vllm_layout import check_engine_layout
from hybridtron.infer.scheduler import Completion
from hybridtron.post.rl.engines.base import RolloutEngine
from hybridtron.post.rl.roles import RoleStopped

PYTHON_ENV = "HYBRIDTRON_VLLM_PYTHON"  # a Python that imports vllm (default: the checkout's .venv-vllm)
WORKER = Path(__file__).with_name("vllm_worker.py")
START_TIMEOUT_S = 900.0
POLL_S = 0.5
# vLLM's CPU backend samples in fp32 (the learner's precision: the smallest mismatch); on GPUs bf16, as RL stacks run
# their rollout engines
CPU_DTYPE, GPU_DTYPE = "float32", "bfloat16"
# GiB of KV cache (and Mamba state) for vLLM on a CPU, unless $VLLM_CPU_KVCACHE_SPACE says otherwise: left to itself
# vLLM's CPU backend sizes the cache as gpu_memory_utilization (0.92 there) of the machine's memory and refuses to
# start unless that much is free (v1/worker/cpu_worker.py), so any other process on the machine stopped the run
CPU_KV_CACHE_GIB = 1


def vllm_python() -> Path:
    """The Python of the vLLM environment: $HYBRIDTRON_VLLM_PYTHON, else `.venv-vllm/bin/python` of the current
    directory or of this checkout (where scripts/setup_vllm.sh makes it)."""
    given = os.environ.get(PYTHON_ENV)
    if given:
        return Path(given)
    checkout = Path(__file__).resolve().parents[5]
    candidates = [Path.cwd() / ".venv-vllm" / "bin" / "python", checkout / ".venv-vllm" / "bin" / "python"]
    return next((path for path in candidates if path.exists()), candidates[-1])


def on_gpu() -> bool:
    return torch.cuda.is_available()


def vllm_blocker(config, model_config, model_dir) -> tuple[str, str] | None:
    """(what vLLM cannot run here, the fix) for an RL section's settings on this model and device, or None."""
    section, gpu = config.SECTION, on_gpu()
    if not gpu:
        moe = [i for i, kind in enumerate(model_config.layers_block_type) if kind == MOE]
        if moe:
            return (f"the model has MoE layers ({', '.join(map(str, moe))}), and vLLM's CPU backend has no kernel for "
                    f"its non-gated relu2 experts (\"is_act_and_mul=False is supported only for CUDA, XPU and ROCm\")",
                    "run the rollouts on GPUs, or use a dense model")
        if config.weight_sync == "nccl":
            return (f"{section}.weight_sync=nccl is vLLM's NCCL weight-transfer engine, which needs GPUs",
                    f"set {section}.weight_sync=reload on a CPU")
    algo = quantization_algo(Path(model_dir))
    if algo is not None:
        return (f"the policy {model_dir} is a ModelOpt {algo} checkpoint: vLLM would sample from the quantized weights "
                f"while the learner trains (and pushes) high-precision ones", "start from the unquantized checkpoint")
    if config.speculative and model_config.mtp_depths:
        kinds = set(model_config.mtp_layers_block_type)
        if kinds - {"full_attention", MOE}:
            return (f"vLLM's nemotron_h MTP drafter builds attention and MoE layers only (model_executor/models/"
                    f"nemotron_h_mtp.py), and this MTP block is {list(model_config.mtp_layers_block_type)}",
                    f"set {section}.speculative=false")
        if not gpu:
            return ("vLLM's CPU backend cannot decode a Mamba hybrid speculatively: its Mamba state copy for "
                    "speculative steps is a Triton kernel (v1/worker/mamba_utils.py), and the CPU build has no Triton "
                    "backend", f"set {section}.speculative=false, or run the rollouts on GPUs")
    return None


def check_vllm(config, model_config, model_dir) -> None:
    """One line (ValueError / FileNotFoundError) if `engine = "vllm"` cannot run here: no vLLM environment, or
    a model or setting vLLM cannot run on this device (`vllm_blocker`)."""
    section = config.SECTION
    python = vllm_python()
    if not python.exists():
        raise FileNotFoundError(f"{section}.engine=vllm: no vLLM environment at {python}; create it with "
                                f"./scripts/setup_vllm.sh (or point {PYTHON_ENV} at a Python that imports vllm), or "
                                f"set {section}.engine=hybridtron")
    check_engine_layout(model_config, config.vllm_layout(), section)
    blocked = vllm_blocker(config, model_config, model_dir)
    if blocked is not None:
        what, fix = blocked
        raise ValueError(f"{section}.engine=vllm: {what}; {fix}, or set {section}.engine=hybridtron")


def _die_with_parent() -> None:  # runs in the child before exec (Linux): SIGTERM when the role's process ends
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class VLLMProcess:
    """A vLLM process (the vllm_worker script) and the connection to it. `call(op, **payload)` returns its answer;
    a failure of vLLM, its start or its process is a `RoleStopped` whose one line names the cause, the log and the
    fix. `section` names the RL section in those lines."""

    def __init__(self, options: dict, *, section: str, workdir: Path):
        self.section, self.workdir, self.log = section, workdir, workdir / "vllm.log"
        self.failed = False  # a failure's line names the log: `discard` keeps it
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        env = {**os.environ, "HYBRIDTRON_VLLM_ADDRESS": json.dumps(listener.address),
               "HYBRIDTRON_VLLM_AUTHKEY": key.hex()}
        # one process: vLLM's engine core in the worker's own (no third process per engine on a small machine)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not on_gpu():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
        python = vllm_python()
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen([str(python), str(WORKER)], env=env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=_die_with_parent)
        try:
            self.connection = self._accept(listener)
        finally:
            listener.close()
        self.connection.send(options)
        self.info = self._answer("starting")

    def _accept(self, listener: Listener):
        accepted: list = []
        thread = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while thread.is_alive():
            thread.join(POLL_S)
            if self.process.poll() is not None:
                self._failed("starting", f"its process exited with code {self.process.returncode}",
                             "its log says why")
            if time.monotonic() > deadline:
                self.close()
                self._failed("starting", f"its process did not connect in {START_TIMEOUT_S:.0f} s", "its log says why")
        return accepted[0]

    def _failed(self, doing: str, cause: str, fix: str | None = None):
        tail = ""
        try:
            lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
            last = lines[-1].strip()[:300] if lines else ""
            tail = f" (the log's last line: {last})" if last and last not in cause else ""
        except OSError:
            pass
        fix = f"; {fix}, or set {self.section}.engine=hybridtron" if fix else ""
        self.failed = True
        raise RoleStopped(f"{self.section}.engine=vllm: vLLM failed while {doing}: {cause}{tail}; its log: "
                          f"{self.log}{fix}")

    def _died(self, doing: str):
        self._failed(doing, f"its process died (exit code {self.process.returncode})",
                     "its log says why; the run's last checkpoint is intact: resume it (--resume)")

    def _answer(self, doing: str):
        while not self.connection.poll(POLL_S):
            if self.process.poll() is not None:
                self._died(doing)
        try:
            status, result = self.connection.recv()
        except (EOFError, OSError):
            self.process.wait(timeout=30)
            self._died(doing)
        if status != "ok":
            if doing == "starting":
                self.close()
            self._failed(doing, result, "its log says why" if doing == "starting" else None)
        return result

    def call(self, op: str, doing: str, **payload):
        try:
            self.connection.send((op, payload))
        except (BrokenPipeError, OSError):
            self.process.wait(timeout=30)
            self._died(doing)
        return self._answer(doing)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.connection.send(("close", None))
                self.process.wait(timeout=30)
            except (AttributeError, OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()

    def discard(self) -> None:
        """Close, and remove the scratch directory (the weights written for vLLM), but for the log a failure named."""
        self.close()
        if not self.failed:
            shutil.rmtree(self.workdir, ignore_errors=True)
            return
        for path in self.workdir.iterdir():
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path != self.log:
                path.unlink(missing_ok=True)


def _seed(seed: int, prompt: int) -> int:
    return (seed * 1_000_003 + prompt * 7_919) % (2 ** 31 - 1)


class VLLMRollouts(RolloutEngine):
    """vLLM generating the rollouts of an RL section `config` (see the module docstring) for the policy of
    `model_config` (`model_dir`: its checkpoint, which vLLM starts from, with the tokenizer and chat template)."""

    def __init__(self, config, *, model_dir: str, model_config, tokenizer):
        check_vllm(config, model_config, model_dir)
        self.section, self.model_config, self.weight_sync = config.SECTION, model_config, config.weight_sync
        self.end_token_ids = tuple(tokenizer.token_id(t) for t in (EOS, IM_END))
        self.routers = [str(i) for i, kind in enumerate(model_config.layers_block_type) if kind == MOE]
        self.workdir = Path(tempfile.mkdtemp(prefix="hybridtron-vllm-"))
        self.weights_dir = self.workdir / "weights"
        gpu = on_gpu()
        speculative = config.draft_length if config.speculative and model_config.mtp_depths else 0
        options = dict(model=str(model_dir), dtype=GPU_DTYPE if gpu else CPU_DTYPE, seed=config.seed,
                       max_model_len=model_config.max_position_embeddings, max_logprobs=20,
                       enforce_eager=not gpu, speculative=speculative,
                       routed_experts=bool(config.routing_replay and self.routers),
                       weight_transfer="nccl" if self.weight_sync == "nccl" else None,
                       engine_args=config.vllm_layout().engine_args())
        self.version: int | None = None
        self.last_stats = None
        self.nccl, self.engine_gpus = None, config.vllm_layout().gpus
        self.process = VLLMProcess(options, section=self.section, workdir=self.workdir)

    # ------------------------------------------------------------------------------------------- weights
    def load_weights(self, version, state_dict) -> None:
        if self.weight_sync == "nccl":
            self._send_nccl(version, state_dict)
        else:
            write_checkpoint(self.weights_dir, self.model_config.to_hf(export=True),
                             {name: t.detach().contiguous().cpu() for name, t in to_disk_state(state_dict).items()},
                             overwrite=True)
            self.process.call("weights", f"loading the weights of step {version}", path=str(self.weights_dir),
                              version=version)
        self.version = version

    def _send_nccl(self, version, state_dict) -> None:
        """vLLM's NCCL weight-transfer engine (v1/worker/gpu_worker.py `init_weight_transfer_engine`,
        `start_weight_update` / `update_weights` / `finish_weight_update`; distributed/weight_transfer/nccl_engine.py
        and nccl_common.py): this process is rank 0 of an NCCL group with the engine's vLLM workers (ranks 1..,
        one a GPU) and broadcasts every tensor, unpacked and in order, while the workers receive and load them. The
        rendezvous helper is vLLM's, so vllm must be importable here too (on GPUs one environment holds both).
        Unverified: written from vLLM's code for GPUs, never run here (no GPU)."""
        import socket

        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        tensors = to_disk_state(state_dict)
        if self.nccl is None:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            world = 1 + self.engine_gpus
            init = dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=world, packed=False)
            joined = threading.Thread(target=self.process.call, args=("nccl_init", "joining the NCCL group"),
                                      kwargs=dict(init_info=init), daemon=True)
            joined.start()  # both ends meet inside the rendezvous
            self.nccl = stateless_init_process_group("127.0.0.1", port, 0, world, torch.cuda.current_device())
            joined.join()
        update = dict(names=list(tensors), dtype_names=[str(t.dtype).split(".")[-1] for t in tensors.values()],
                      shapes=[list(t.shape) for t in tensors.values()])
        received = threading.Thread(target=self.process.call, args=("nccl_update", f"receiving step {version}"),
                                    kwargs=dict(update_info=update, version=version), daemon=True)
        received.start()
        for tensor in tensors.values():
            self.nccl.broadcast(tensor.cuda(), src=0, stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        received.join()

    # ---------------------------------------------------------------------------------------- generation
    def generate(self, prompts, params, n, *, version, expert_ids=False, first_prompt=0):
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2 ** 31 - 1, ()))
        sampling = dict(temperature=params.temperature, top_k=params.top_k or -1, top_p=params.top_p,
                        max_tokens=params.max_tokens, stop=list(params.stop),
                        stop_token_ids=sorted({*params.stop_token_ids, *self.end_token_ids}))
        experts = bool(expert_ids and self.routers)
        samples = self.process.call("generate", f"generating with the weights of step {version}",
                                    prompts=[list(p) for p in prompts], params=sampling, n=n, version=version,
                                    seeds=[_seed(seed, first_prompt + i) for i in range(len(prompts))],
                                    experts=experts)
        return [[self._completion(prompt, sample, expert_ids) for sample in row]
                for prompt, row in zip(prompts, samples)]

    def _completion(self, prompt, sample: dict, expert_ids: bool) -> Completion:
        tokens = sample["token_ids"]
        routed = None  # a dense model has nothing to replay, as with hybridtron's engine
        if expert_ids and self.routers:
            if sample["routed_experts"] is None:
                raise RoleStopped(f"{self.section}.routing_replay=true: vLLM returned no routed experts for a sample "
                                  f"(enable_return_routed_experts is on); set {self.section}.routing_replay=false "
                                  f"or {self.section}.engine=hybridtron")
            ids = torch.tensor(sample["routed_experts"], dtype=torch.long)  # [tokens, MoE layers, K]
            read = len(prompt) + max(len(tokens) - 1, 0)  # the last sampled token is never read
            routed = {name: ids[:read, layer] for layer, name in enumerate(self.routers)}
        reason = "stop" if sample["finish_reason"] == "stop" else "length"
        return Completion(prompt_ids=list(prompt), token_ids=list(tokens),
                          logprobs=torch.tensor(sample["logprobs"], dtype=torch.float32), finish_reason=reason,
                          expert_ids=routed, top_logprobs=None)

    def score(self, sequences: list[list[int]], top_k: int) -> list:
        """Per sequence, per position 1..: (log p of its token, the top_k ids, their log-probs) under the plain
        distribution (temperature 1, unfiltered)."""
        return self.process.call("score", "scoring", sequences=sequences, top_k=top_k)

    def held_version(self) -> str:
        """The weight version vLLM itself holds (its label)."""
        return self.process.call("version", "reading the weight version")

    def close(self) -> None:
        self.process.discard()


# ------------------------------------------------------------------------------------------ teacher scoring
def check_vllm_teacher(section: str, temperature: float, model_config, directory: str) -> None:
    """One line if a teacher cannot score on vLLM: no vLLM environment, a MoE teacher on a CPU, or a temperature
    other than 1 (what vLLM's prompt log-probs lack: see `VLLMTeacher`)."""
    python = vllm_python()
    if not python.exists():
        raise FileNotFoundError(f"{section}.teacher_engine=vllm: no vLLM environment at {python}; create it with "
                                f"./scripts/setup_vllm.sh (or point {PYTHON_ENV} at a Python that imports vllm), or "
                                f"set {section}.teacher_engine=hybridtron")
    if temperature != 1:
        raise ValueError(f"{section}.teacher_engine=vllm: the teachers score at the rollouts' temperature "
                         f"({section}.temperature={temperature}), and vLLM's prompt log-probs are the plain "
                         f"log-softmax: prompt tokens skip its sampling processors, so no temperature scales them "
                         f"(vllm config/model.py, logprobs_mode); set {section}.temperature=1 or "
                         f"{section}.teacher_engine=hybridtron")
    moe = [i for i, kind in enumerate(model_config.layers_block_type) if kind == MOE]
    if moe and not on_gpu():
        raise ValueError(f"{section}.teacher_engine=vllm: the teacher {directory} has MoE layers "
                         f"({', '.join(map(str, moe))}), and vLLM's CPU backend has no kernel for its non-gated relu2 "
                         f"experts; score on GPUs, or set {section}.teacher_engine=hybridtron")


class VLLMTeacher:
    """A frozen teacher scoring on vLLM (hybridtron.post.teachers.TeacherScoringRole with `engine="vllm"`): each
    rollout's prompt + completion goes in as a prompt, and vLLM's prompt log-probs with the top `top_k`
    (`SamplingParams(prompt_logprobs=k)`) give, at every completion position, the teacher's log-prob of the sampled
    token and its K most likely tokens with their log-probs: exactly the teacher's `token_scores` at temperature 1
    (tests/with_vllm/test_vllm_rollouts.py), the only temperature at which they are what the loss needs
    (`check_vllm_teacher`)."""

    def __init__(self, directory: str, *, section: str, top_k: int):
        self.config, self.top_k = ModelConfig.from_hf(directory), top_k
        self.workdir = Path(tempfile.mkdtemp(prefix="hybridtron-vllm-teacher-"))
        gpu = on_gpu()
        options = dict(model=str(directory), dtype=GPU_DTYPE if gpu else CPU_DTYPE, seed=0,
                       max_model_len=self.config.max_position_embeddings, max_logprobs=max(20, top_k),
                       enforce_eager=not gpu, speculative=0, routed_experts=False, weight_transfer=None)
        self.process = VLLMProcess(options, section=section, workdir=self.workdir)

    def score(self, rollouts) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Per rollout: the teacher's log-prob of each completion token (float32 [C]) and, with top_k, its top-K
        ids (int32 [C, K]) and their log-probs (float32 [C, K])."""
        rows = self.process.call("score", "scoring rollouts", top_k=self.top_k,
                                 sequences=[list(r.prompt_ids) + list(r.completion_ids) for r in rollouts])
        scores = []
        for rollout, positions in zip(rollouts, rows):
            mine = positions[len(rollout.prompt_ids) - 1:]  # row t scores the token at t + 1
            logp = torch.tensor([row[0] for row in mine], dtype=torch.float32)
            if not self.top_k:
                scores.append((logp, None, None))
                continue
            scores.append((logp, torch.tensor([row[1] for row in mine], dtype=torch.int32),
                           torch.tensor([row[2] for row in mine], dtype=torch.float32)))
        return scores

    def close(self) -> None:
        self.process.discard()
