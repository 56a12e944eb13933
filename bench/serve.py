"""Serving throughput and latency under concurrent requests: the engine in process (an HTTP client and transformers'
`generate` baseline plug in as more `Client`s).

    python bench/serve.py --checkpoint /tmp/quickstart/hf --threads 1

Prompts: the first 128 tokens of the source of standard-library modules (one per request, cycled), greedy, 128 new
tokens each (fewer if a request meets an end token). Two sections, each for the plain and the speculative engine
(`HybridEngine(speculative=...)`, its default adaptive draft length), one engine per kind:

1. `burst` (the continuous-batching goal): 8 requests submitted at once against the same 8 one after another, on
   the same engine: the ratio of their throughputs (generated tokens / elapsed seconds; goal >= 3x). Each request's
   tokens must be the same both ways (greedy batched == alone) before anything counts.
2. `concurrency`: closed-loop clients (1, 4 and 16 by default), each sending its next request when the last one
   finished, `--requests` requests in all: throughput, request latency p50 / p99 and time to the first token
   p50 / p99.

Every measurement is repeated (`--repeats`), the variants back to back in each repetition; the tables report the
fastest repetition (throughput) and that repetition's latencies. Times are elapsed (wall clock): a request's
latency is what a client waits. The engine's loop runs in its own thread; the clients only wait.

To add a client (the HTTP server's, transformers'), implement `Client.complete` and add it to `clients()`.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridtron.infer.engine import HybridEngine, load_engine
from hybridtron.infer.sampling import SamplingParams

STDLIB_MODULES = ("json.decoder", "textwrap", "collections", "argparse", "functools", "string", "csv", "shlex",
                  "calendar", "difflib", "fractions", "heapq", "pprint", "statistics", "tokenize", "zipfile")


@dataclass
class Sample:
    token_ids: list[int]
    first_token_s: float  # from the request to its first token
    total_s: float  # from the request to its last token


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
            tokens = sum(len(s.token_ids) for s in alone)
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


def bench_concurrency(clients: list[Client], prompts, args, log) -> str:
    results = {}
    for repeat in range(args.repeats):
        for concurrency in args.concurrency:
            log(f"  concurrency {concurrency}, repeat {repeat + 1}/{args.repeats}")
            for client in clients:
                samples, elapsed = closed_loop(client, prompts, args.requests, concurrency, args.max_tokens)
                tokens = sum(len(s.token_ids) for s in samples)
                key = (client.name, concurrency)
                if key not in results or tokens / elapsed > results[key][0]:
                    results[key] = (tokens / elapsed, samples)
    lines = [f"{args.requests} requests of up to {args.max_tokens} greedy tokens from closed-loop clients; the "
             f"fastest of {args.repeats} repetitions and its latencies (seconds).", "",
             "| engine | clients | tok/s | requests/s | latency p50 | latency p99 | first token p50 | "
             "first token p99 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for client in clients:
        for concurrency in args.concurrency:
            rate, samples = results[client.name, concurrency]
            latency = [s.total_s for s in samples]
            first = [s.first_token_s for s in samples]
            mean_tokens = statistics.mean(len(s.token_ids) for s in samples)
            lines.append(f"| {client.name} | {concurrency} | {rate:.1f} | {rate / mean_tokens:.2f} | "
                         f"{percentile(latency, 50):.2f} | {percentile(latency, 99):.2f} | "
                         f"{percentile(first, 50):.3f} | {percentile(first, 99):.3f} |")
    return "\n".join(lines)


def clients(args) -> tuple[list[Client], list[HybridEngine]]:
    engines = [load_engine(args.checkpoint, speculative=False, max_slots=args.slots),
               load_engine(args.checkpoint, speculative=True, max_slots=args.slots)]
    for engine in engines:
        engine.start()
    return [EngineClient(engines[0], "plain"), EngineClient(engines[1], "speculative (adaptive)")], engines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="/tmp/quickstart/hf", help="a checkpoint or run directory")
    parser.add_argument("--sections", nargs="+", default=["burst", "concurrency"], choices=["burst", "concurrency"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--burst", type=int, default=8, help="requests of the burst section")
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--slots", type=int, default=16)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    log = lambda line: print(line, flush=True)  # noqa: E731
    client_list, engines = clients(args)
    prompts = stdlib_prompts(engines[0].encode, len(STDLIB_MODULES), args.prompt_tokens)
    out = [f"torch {torch.__version__}, torch.set_num_threads({args.threads}), wall clock; {args.checkpoint}"]
    try:
        if "burst" in args.sections:
            log("burst ...")
            out.append(bench_burst(client_list, prompts, args, log))
        if "concurrency" in args.sections:
            log("concurrency ...")
            out.append(bench_concurrency(client_list, prompts, args, log))
    finally:
        for engine in engines:
            engine.shutdown(cancel=True)
    print("\n\n".join(out))


if __name__ == "__main__":
    main()
