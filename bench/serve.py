"""Serving throughput and latency under concurrent requests: the engine in process, the same engine over HTTP
(`hybridtron serve` in a subprocess, streamed completions), and transformers' `generate` on the same
checkpoint as a baseline.

    python bench/serve.py --checkpoint /tmp/quickstart/hf --threads 1

Prompts: the first 128 tokens of the source of standard-library modules (one per request, cycled), greedy, 128 new
tokens each (fewer if a request meets an end token). Sections:

1. `burst` (the continuous-batching goal; in-process engines only): 8 requests submitted at once against the same 8
   one after another, on the same engine: the ratio of their throughputs (generated tokens / elapsed seconds; goal
   >= 3x). Each request's tokens must be the same both ways (greedy batched == alone) before anything counts.
2. `concurrency`: closed-loop clients (1, 4 and 16 by default), each sending its next request when the last one
   finished, `--requests` requests in all: throughput, request latency p50 / p99 and time to the first token
   p50 / p99. Clients (`--clients`): `plain` and `speculative` (`HybridEngine.submit` in process, its default
   adaptive draft length), `http` (a `hybridtron serve --threads 1` subprocess, speculative and adaptive, streamed
   completions read with `http.client`: the time to the first token is that of the first text chunk), and
   `transformers` (`AutoModelForCausalLM.generate` on the HF export, greedy, the end tokens as eos: it has no
   continuous batching, so `c` clients are served as static batches of `c` left-padded prompts, each request
   waiting for its whole batch; `--baseline-requests` per level, at least `c`, one repetition, for it is slow).

Every engine measurement is repeated (`--repeats`), the variants back to back in each repetition; the tables report
the fastest repetition (throughput) and that repetition's latencies. Times are elapsed (wall clock): a request's
latency is what a client waits. The engine's loop runs in its own thread (or process, over HTTP); the clients only
wait.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridtron.infer.engine import HybridEngine, load_engine
from hybridtron.infer.sampling import SamplingParams

STDLIB_MODULES = ("json.decoder", "textwrap", "collections", "argparse", "functools", "string", "csv", "shlex",
                  "calendar", "difflib", "fractions", "heapq", "pprint", "statistics", "tokenize", "zipfile")


@dataclass
class Sample:
    token_ids: list[int] | None  # None over HTTP, where only the count comes back
    first_token_s: float  # from the request to its first token
    total_s: float  # from the request to its last token
    tokens: int = -1  # generated tokens (len(token_ids) when given)

    def __post_init__(self):
        if self.token_ids is not None:
            self.tokens = len(self.token_ids)


class Client(Protocol):
    name: str

    def complete(self, prompt_ids: list[int], max_tokens: int) -> Sample: ...


class EngineClient:
    """Requests straight to `HybridEngine.submit`, tokens from the handle's events."""

    def __init__(self, engine: HybridEngine, name: str):
        self.engine, self.name = engine, name

    def complete(self, prompt_ids: list[int], max_tokens: int) -> Sample:
        started = time.perf_counter()
        first, tokens = None, []
        for event in self.engine.submit(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens)):
            if event.token_id is not None:
                tokens.append(event.token_id)
                first = first or time.perf_counter()
        done = time.perf_counter()
        return Sample(tokens, (first or done) - started, done - started)


class HTTPClient:
    """Streamed completions (server-sent events) from a `hybridtron serve` subprocess, read with the standard
    library's `http.client`, one connection per client thread (a heavier client such as `openai`'s costs this
    2-core machine about 2 ms of CPU per chunk, which the server then lacks); the token count is the server's usage."""

    def __init__(self, base_url: str, model: str, name: str):
        self.name, self.model = name, model
        self.host, self.port = base_url.removeprefix("http://").split(":")
        self.local = threading.local()

    def complete(self, prompt_ids: list[int], max_tokens: int) -> Sample:
        import http.client
        import json

        if not hasattr(self.local, "connection"):
            self.local.connection = http.client.HTTPConnection(self.host, int(self.port), timeout=600)
        body = json.dumps({"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}})
        started = time.perf_counter()
        self.local.connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = self.local.connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        first, usage = None, None
        for line in response:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
        done = time.perf_counter()
        return Sample(None, (first or done) - started, done - started, tokens=usage["completion_tokens"])


@contextlib.contextmanager
def serve_subprocess(checkpoint: str, threads: int, slots: int):
    """`hybridtron serve` on a free loopback port; yields (base URL, model name)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "hybridtron", "serve", "--model", checkpoint, "--port", str(port),
               "--threads", str(threads), "--max-slots", str(slots), "--max-queue", "4096", "--request-timeout", "0"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "NO_PROXY": "127.0.0.1"})
    base = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 300
    try:
        while True:
            try:
                with opener.open(base + "/v1/models", timeout=5) as response:
                    import json

                    model = json.loads(response.read())["data"][0]["id"]
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"hybridtron serve did not start: {process.stderr.read()[-2000:]}") from None
                time.sleep(0.5)
        yield base, model
    finally:
        process.terminate()
        process.wait(60)


class TransformersBaseline:
    """transformers' `generate` on the checkpoint's HF export: `concurrency` requests as one static batch."""

    name = "transformers generate (static batches)"

    def __init__(self, checkpoint: str, end_token_ids: tuple[int, ...], pad_id: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        self.end_token_ids, self.pad_id = list(end_token_ids), pad_id

    def batch(self, prompts: list[list[int]], max_tokens: int) -> list[Sample]:
        """One generate call over left-padded prompts; each request's latency is the batch's."""
        from transformers.generation.streamers import BaseStreamer

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        first: list[float] = []

        class FirstToken(BaseStreamer):
            calls = 0

            def put(self, value):  # the prompt, then each new token
                self.calls += 1
                if self.calls == 2:
                    first.append(time.perf_counter())

            def end(self):
                pass

        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                      eos_token_id=self.end_token_ids, pad_token_id=self.pad_id,
                                      streamer=FirstToken())
        done = time.perf_counter()
        samples = []
        for row in out[:, width:].tolist():
            count = next((i + 1 for i, t in enumerate(row) if t in self.end_token_ids), len(row))
            # a batch's first token comes from its first forward: the same time for every row
            samples.append(Sample(row[:count], (first[0] if first else done) - started, done - started))
        return samples

    def closed_loop(self, prompts, requests: int, concurrency: int, max_tokens: int) -> tuple[list[Sample], float]:
        samples, started = [], time.perf_counter()
        for start in range(0, requests, concurrency):
            batch = [prompts[i % len(prompts)] for i in range(start, min(start + concurrency, requests))]
            samples += self.batch(batch, max_tokens)
        return samples, time.perf_counter() - started


def stdlib_prompts(encode, count: int, tokens: int) -> list[list[int]]:
    import importlib
    import inspect

    prompts = []
    for name in STDLIB_MODULES[:count]:
        source = inspect.getsource(importlib.import_module(name))
        prompts.append(encode(source[:tokens * 8])[:tokens])
    return prompts


def closed_loop(client: Client, prompts: list[list[int]], requests: int, concurrency: int,
                max_tokens: int) -> tuple[list[Sample], float]:
    """`concurrency` clients, each sending its next request when its last one finished, `requests` in all: (the
    samples in request order, elapsed seconds)."""
    samples: list[Sample | None] = [None] * requests
    lock = threading.Lock()
    next_request = [0]
    failures: list[BaseException] = []

    def client_loop():
        while True:
            with lock:
                index = next_request[0]
                next_request[0] += 1
            if index >= requests:
                return
            try:
                samples[index] = client.complete(prompts[index % len(prompts)], max_tokens)
            except BaseException as exc:  # reported after the run
                failures.append(exc)
                return

    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"{client.name}: a request failed") from failures[0]
    return samples, elapsed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def bench_burst(clients: list[Client], prompts, args, log) -> str:
    best = {}
    for repeat in range(args.repeats):
        log(f"  burst, repeat {repeat + 1}/{args.repeats}")
        for client in clients:
            alone, alone_s = closed_loop(client, prompts, args.burst, 1, args.max_tokens)
            together, together_s = closed_loop(client, prompts, args.burst, args.burst, args.max_tokens)
            if [s.token_ids for s in alone] != [s.token_ids for s in together]:
                raise RuntimeError(f"{client.name}: a request's greedy tokens differ batched and alone")
            tokens = sum(s.tokens for s in alone)
            for key, seconds in (("alone", alone_s), ("together", together_s)):
                best[client.name, key] = min(best.get((client.name, key), float("inf")), seconds)
            best[client.name, "tokens"] = tokens
    lines = [f"{args.burst} requests of up to {args.max_tokens} greedy tokens (prompts of {args.prompt_tokens} "
             f"tokens): one after another, then all at once; fastest of {args.repeats} repetitions; each request's "
             f"tokens identical both ways.", "",
             "| engine | tokens | one after another tok/s | all at once tok/s | ratio |", "|---|---:|---:|---:|---:|"]
    for client in clients:
        tokens = best[client.name, "tokens"]
        alone, together = tokens / best[client.name, "alone"], tokens / best[client.name, "together"]
        lines.append(f"| {client.name} | {tokens} | {alone:.1f} | {together:.1f} | {together / alone:.2f}x |")
    lines.append("")
    for client in clients:
        ratio = best[client.name, "alone"] / best[client.name, "together"]
        lines.append(f"goal >= 3x, {client.name}: {'met' if ratio >= 3 else 'MISSED'} ({ratio:.2f}x)")
    reference = clients[0]
    for client in clients[1:]:
        lines.append(f"{client.name} all at once / {reference.name} one after another: "
                     f"{best[reference.name, 'alone'] / best[client.name, 'together']:.2f}x")
    return "\n".join(lines)


def bench_concurrency(clients: list[Client], prompts, args, log, baseline=None) -> str:
    for client in clients:  # warm up: the first requests of a process pay one-time costs
        closed_loop(client, prompts, 2, 2, args.max_tokens)
    results = {}
    for repeat in range(args.repeats):
        for concurrency in args.concurrency:
            log(f"  concurrency {concurrency}, repeat {repeat + 1}/{args.repeats}")
            for client in clients:
                samples, elapsed = closed_loop(client, prompts, args.requests, concurrency, args.max_tokens)
                tokens = sum(s.tokens for s in samples)
                key = (client.name, concurrency)
                if key not in results or tokens / elapsed > results[key][0]:
                    results[key] = (tokens / elapsed, samples)
    names = [client.name for client in clients]
    if baseline is not None:
        names.append(baseline.name)
        for concurrency in args.concurrency:
            requests = max(args.baseline_requests, concurrency)
            log(f"  {baseline.name}, concurrency {concurrency} ({requests} requests)")
            samples, elapsed = baseline.closed_loop(prompts, requests, concurrency, args.max_tokens)
            results[baseline.name, concurrency] = (sum(s.tokens for s in samples) / elapsed, samples)
    lines = [f"{args.requests} requests of up to {args.max_tokens} greedy tokens from closed-loop clients; the "
             f"fastest of {args.repeats} repetitions and its latencies (seconds)"
             + (f"; {baseline.name}: max({args.baseline_requests}, clients) requests, one repetition" if baseline
                else "") + ".", "",
             "| engine | clients | tok/s | requests/s | latency p50 | latency p99 | first token p50 | "
             "first token p99 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        for concurrency in args.concurrency:
            rate, samples = results[name, concurrency]
            latency = [s.total_s for s in samples]
            first = [s.first_token_s for s in samples]
            mean_tokens = statistics.mean(s.tokens for s in samples)
            lines.append(f"| {name} | {concurrency} | {rate:.1f} | {rate / mean_tokens:.2f} | "
                         f"{percentile(latency, 50):.2f} | {percentile(latency, 99):.2f} | "
                         f"{percentile(first, 50):.3f} | {percentile(first, 99):.3f} |")
    if baseline is not None:
        lines.append("")
        for name in names[:-1]:
            ratios = ", ".join(f"{results[name, c][0] / results[baseline.name, c][0]:.1f}x at {c}"
                               for c in args.concurrency)
            lines.append(f"{name} / {baseline.name} throughput: {ratios}")
    return "\n".join(lines)


ENGINE_CLIENTS = ("plain", "speculative")


def engine_clients(args) -> tuple[list[Client], list[HybridEngine]]:
    kinds = [kind for kind in ENGINE_CLIENTS if kind in args.clients]
    engines = [load_engine(args.checkpoint, speculative=kind == "speculative", max_slots=args.slots)
               for kind in kinds]
    for engine in engines:
        engine.start()
    names = {"plain": "plain", "speculative": "speculative (adaptive)"}
    return [EngineClient(engine, names[kind]) for kind, engine in zip(kinds, engines)], engines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="/tmp/quickstart/hf", help="a checkpoint or run directory")
    parser.add_argument("--sections", nargs="+", default=["burst", "concurrency"], choices=["burst", "concurrency"])
    parser.add_argument("--clients", nargs="+", default=["plain", "speculative", "http", "transformers"],
                        choices=["plain", "speculative", "http", "transformers"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--burst", type=int, default=8, help="requests of the burst section")
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--baseline-requests", type=int, default=8,
                        help="transformers: requests per concurrency level (at least the level)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--slots", type=int, default=16)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    log = lambda line: print(line, flush=True)  # noqa: E731
    from hybridtron.infer.engine import resolve_checkpoint_dir
    from hybridtron.data.tokenizer import Tokenizer

    checkpoint_dir, _ = resolve_checkpoint_dir(args.checkpoint)
    tokenizer = Tokenizer.load(checkpoint_dir / "tokenizer.json")
    prompts = stdlib_prompts(tokenizer.encode, len(STDLIB_MODULES), args.prompt_tokens)
    out = [f"torch {torch.__version__}, torch.set_num_threads({args.threads}), wall clock; {args.checkpoint}"]
    client_list, engines = engine_clients(args)
    with contextlib.ExitStack() as stack:
        if "http" in args.clients:
            base, model = stack.enter_context(serve_subprocess(args.checkpoint, args.threads, args.slots))
            client_list.append(HTTPClient(base, model, "http (speculative, adaptive)"))
        baseline = None
        if "transformers" in args.clients:
            from hybridtron.data.tokenizer import EOS, IM_END

            baseline = TransformersBaseline(str(checkpoint_dir), tuple(tokenizer.token_id(t) for t in (EOS, IM_END)),
                                            tokenizer.pad_id)
        try:
            if "burst" in args.sections and engines:
                log("burst ...")
                out.append(bench_burst(client_list[:len(engines)], prompts, args, log))
            if "concurrency" in args.sections:
                log("concurrency ...")
                out.append(bench_concurrency(client_list, prompts, args, log, baseline))
        finally:
            for engine in engines:
                engine.shutdown(cancel=True)
    print("\n\n".join(out))


if __name__ == "__main__":
    main()
