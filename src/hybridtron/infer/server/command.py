"""`hybridtron serve`: the command that serves a checkpoint with the OpenAI-compatible API of
hybridtron.infer.server (its docstring says what the server does)."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch

from hybridtron.checkpoint.hf import resolve_checkpoint_dir
from hybridtron.data.chat import declared_chat_template
from hybridtron.files import RUN_CONFIG
from hybridtron.infer.engine import load_engine
from hybridtron.infer.server import create_app, require_serving_dependencies
from hybridtron.infer.server.settings import API_KEY_ENV, DEFAULT_REQUEST_TIMEOUT_S
from hybridtron.ops.compile_cache import use_compile_cache


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True,
                        help="checkpoint directory (Hugging Face layout), or a run directory (its hf/ export); "
                             "required")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on; 0.0.0.0 for every interface (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000,
                        help="TCP port; 0 = a free one, printed at start (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in the API (default: the checkpoint's directory name, or the run's)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1/ routes (401 without it; default: "
                             f"${API_KEY_ENV} if set, else no authentication). An empty key (an unset shell "
                             f"variable expands to one) is an error: the server does not start")
    parser.add_argument("--no-speculative", action="store_true",
                        help="decode one token per forward instead of drafting with the MTP block")
    parser.add_argument("--draft-length", type=int, default=None,
                        help="tokens the MTP block drafts per step (default: adapted to the measured acceptance, "
                             "off where drafting does not pay)")
    parser.add_argument("--compile", action="store_true",
                        help="compile the decode steps with torch.compile (the first requests of each batch shape "
                             "wait for a compile)")
    parser.add_argument("--compile-cache", metavar="DIR", default=None,
                        help="with --compile: keep torch.compile's caches in DIR, so that a later server compiling "
                             "the same steps loads them instead (default: torch's own cache directory)")
    parser.add_argument("--max-slots", type=int, default=None,
                        help="sequences decoding at once (default: the engine's, 64; or what --memory-budget-gib "
                             "holds)")
    parser.add_argument("--memory-budget-gib", type=float, default=None,
                        help="size the slots to this much KV cache and SSM state memory (default: none; see "
                             "hybridtron memory --budget-gib)")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests waiting for a slot at most; beyond it a request gets 503 (default: "
                             "%(default)s)")
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                        help="seconds a request may run before it is cancelled with 504; 0 = no limit (default: "
                             "%(default)s)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="at shutdown, seconds in-flight requests may take to finish before they are cancelled "
                             "(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's, one per core)")


def required_api_key(args) -> str | None:
    """The key /v1/ routes require: --api-key, else $HYBRIDTRON_API_KEY, else None (no authentication). An empty one
    is an error: `--api-key "$KEY"` with KEY unset would otherwise serve everyone while the user believes a key is
    required."""
    for value, name in ((args.api_key, "--api-key"), (os.environ.get(API_KEY_ENV), f"${API_KEY_ENV}")):
        if value is None:
            continue
        if not value.strip():
            raise ValueError(f"{name} is empty (an unset shell variable?): give the key clients must send, or leave "
                             f"{name} out to serve without authentication")
        return value
    return None


def _check(args) -> Path:
    """Refuse bad options before the port is bound and the model loads; returns the checkpoint directory."""
    if args.draft_length is not None and args.draft_length < 1:
        raise ValueError(f"--draft-length must be >= 1, got {args.draft_length}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    for name in ("max_slots", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    for name in ("request_timeout", "shutdown_timeout"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 seconds, got {getattr(args, name)}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name must not be empty")
    if args.compile_cache and not args.compile:
        raise ValueError("--compile-cache applies to --compile (nothing is compiled without it)")
    return resolve_checkpoint_dir(args.model)[0]


def chat_template_note(model_dir: Path) -> str | None:
    """The start line's warning for a model that was never fine-tuned for chat, which /v1/chat/completions answers
    with noise: a checkpoint that declares no chat template, or the export of a pretraining run (hybridtron writes its
    template into every export, a base model's too, so that `eval tasks` and `mtp-boost` can render prompts for it:
    the run's own configuration, beside its hf/, tells a base model by its text-mixture [data] section, where SFT,
    GRPO and MOPD name a data file or an environment). None for a chat model, or where nothing tells."""
    why = None
    if declared_chat_template(model_dir)[0] is None:
        why = (f"{model_dir} declares no chat template (no chat_template in tokenizer_config.json or "
               f"chat_template.jinja)")
    elif model_dir.name == "hf" and (run_config := model_dir.parent / RUN_CONFIG).is_file():
        try:
            data = json.loads(run_config.read_text()).get("data")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            data = None  # not ours to judge: the server starts all the same
        if isinstance(data, dict):
            why = (f"{model_dir} is the export of a pretraining run ({run_config} trains on a text mixture): a base "
                   f"model, never fine-tuned for chat")
    if why is None:
        return None
    return (f"hybridtron serve: {why}; /v1/chat/completions renders every conversation in hybridtron's ChatML format "
            f"(hybridtron.data.chat) all the same, and a model not fine-tuned on that format answers it with noise: "
            f"send plain text to /v1/completions, or fine-tune it with `hybridtron sft` first")


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), before the model loads: a port in use fails in a second, not after the load,
    and port 0 becomes the free port the system picked, which the start line prints."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    return sock


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(args) -> int:
    note = chat_template_note(_check(args))
    key = required_api_key(args)
    try:
        require_serving_dependencies()
    except ImportError as exc:
        print(f"hybridtron serve: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn  # the optional `serve` extra, checked above

    sock = listen(args.host, args.port)
    try:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        if args.compile_cache and (warning := use_compile_cache(args.compile_cache)):
            print(warning, file=sys.stderr)
        options = {name: getattr(args, name) for name in ("max_slots", "memory_budget_gib")
                   if getattr(args, name) is not None}
        engine = load_engine(args.model, speculative=not args.no_speculative, draft_length=args.draft_length,
                             compile=args.compile, max_queue=args.max_queue, **options)
        if args.served_model_name is not None:
            engine.model_name = args.served_model_name
        app = create_app(engine, api_key=key, request_timeout=args.request_timeout or None)
        port = sock.getsockname()[1]
        access = "clients must send the API key" if key else "no API key: every client is served"
        print(f"hybridtron serve: {engine.model_name} on {url(args.host, port)}/v1 ({access})", file=sys.stderr)
        if note is not None:
            print(note, file=sys.stderr)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=port, log_level="info",
                                               timeout_graceful_shutdown=args.shutdown_timeout))
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down for: the way to stop a server
            pass
    finally:
        sock.close()
    if not server.started:
        print("hybridtron serve: error: the server did not start (uvicorn's log above says why)", file=sys.stderr)
        return 1
    return 0
