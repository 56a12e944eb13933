"""The sandbox under agentic load: tool calls per second through the turn loop with 1 and 16 concurrent
trajectories, and what each hostile call comes back as.

    python bench/sandbox_tools.py --env terminal --concurrency 1,16 --turns 8

Each side runs `--concurrency` trajectories of the environment at once through `hybridtron.post.agentic.run_episodes`
with a scripted "model" (no network to run: each turn is the task's reference tool call, `--turns` of them, then an
answer), so the time is the tools': every call a sandboxed process of its own (namespaces, Landlock, limits; the
`terminal` env's `bash` or `math-python`'s `python`), the trajectories' calls of a turn run in threads side by side.
Reports calls/s over the whole side (the episode's setup, writing the task's tree, and its grading included) and the
latency of one call (median, 95th percentile), after one untimed warm-up side. Then `--hostile`: a fork bomb (and one
that keeps its shell alive), the network, writes outside the task directory, a sleep past the limit and 100 MB of
output, each one call in one trajectory, with the error it came back as, its wall time and the first words the
model reads; the trajectory must go on to its answer.

Record the CPU model and flags with the numbers (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from clock import cpu_model

HOSTILE = {
    "fork bomb": ":(){ :|:& };:",
    "fork bomb, shell kept alive": ":(){ :|:& };:; sleep 60",
    "network (TCP connect)": "echo hi > /dev/tcp/1.1.1.1/80",
    "write outside the task directory": "touch /escape /etc/escape ../escape",
    "sleep past the limit": "sleep 60",
    "100 MB of output": "head -c 100000000 /dev/zero | tr '\\0' a",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="terminal", choices=("terminal", "math-python"))
    parser.add_argument("--concurrency", default="1,16", help="trajectories at once, per side (default 1,16)")
    parser.add_argument("--turns", type=int, default=8, help="tool calls per trajectory (default 8)")
    parser.add_argument("--no-hostile", dest="hostile", action="store_false", help="skip the hostile calls")
    args = parser.parse_args()

    import torch

    from hybridtron.data.tokenizer import IM_END, Tokenizer
    from hybridtron.envs import get_env
    from hybridtron.envs.agentic import TOOL_SANDBOX, SandboxEpisode, summarize
    from hybridtron.infer.sampling import SamplingParams
    from hybridtron.infer.scheduler import Completion
    from hybridtron.post.agentic import run_episodes

    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores (os.sched_getaffinity: {len(os.sched_getaffinity(0))}); "
          f"load average {os.getloadavg()[0]:.1f}")
    tokenizer = Tokenizer.train(["<tool_call> bash python \\boxed{} Done.\n"] * 20, vocab_size=512)
    end = tokenizer.token_id(IM_END)
    latencies: list[float] = []

    def scripted(tasks, first_turn, later_turn):
        def generate(prompts, params):
            out = []
            for ids in prompts:
                text = tokenizer.decode(ids)
                task = next(t for t in tasks if t.prompt in text)
                reply = first_turn(task) if "<tool_response>" not in text else later_turn(task, text)
                tokens = tokenizer.encode(reply) + [end]
                out.append(Completion(list(ids), tokens, torch.zeros(len(tokens)), "stop"))
            return out
        return generate

    def timed(env):
        """`env` with each tool call's wall time recorded."""
        open_episode = env.episode

        def episode(task):
            inner = open_episode(task)
            call = inner.call

            def timed_call(name, arguments):
                started = time.perf_counter()
                try:
                    return call(name, arguments)
                finally:
                    latencies.append(time.perf_counter() - started)
            inner.call = timed_call
            return inner
        env.episode = episode
        return env

    params = SamplingParams(max_tokens=4096, temperature=0.0)
    sides = [int(c) for c in args.concurrency.split(",")]
    print(f"env {args.env}, {args.turns} tool calls per trajectory; limits per call: {TOOL_SANDBOX.wall_s:g} s wall, "
          f"{TOOL_SANDBOX.cpu_s} s CPU, {TOOL_SANDBOX.output_bytes} B output")
    with timed(get_env(args.env)) as env:
        for warmup, concurrency in [(True, sides[0])] + [(False, c) for c in sides]:
            tasks = env.tasks("train", concurrency, seed=concurrency + 100 * warmup)
            latencies.clear()

            def later(task, text, turns=args.turns):
                if text.count("<tool_response>") < turns:
                    return task.reference
                output = text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
                return f"\\boxed{{{output.strip()}}}" if task.answer is not None else "Done."

            started = time.perf_counter()
            trajectories = run_episodes(scripted(tasks, lambda task: task.reference, later), tokenizer, env, tasks,
                                        params, max_turns=args.turns + 1, token_budget=1 << 20,
                                        tool_threads=concurrency)
            seconds = time.perf_counter() - started
            calls = sum(t.stats.calls for t in trajectories)
            if warmup:
                continue
            summary, lat = summarize(trajectories), sorted(latencies)
            print(f"{concurrency:3d} concurrent: {calls} calls in {seconds:.2f} s = {calls / seconds:.1f} calls/s; "
                  f"per call median {statistics.median(lat) * 1000:.0f} ms, "
                  f"p95 {lat[int(0.95 * (len(lat) - 1))] * 1000:.0f} ms, max {lat[-1] * 1000:.0f} ms; "
                  f"solved {summary['pass_rate'] * len(tasks):.0f}/{len(tasks)}; errors {summary['errors'] or 'none'}")
    if not args.hostile:
        return
    with get_env("terminal") as env:
        (task,) = env.tasks("train", 1, seed=0)
        env.episode = lambda t: SandboxEpisode(env, t)
        print(f"hostile calls (one trajectory each; limits {TOOL_SANDBOX.wall_s:g} s wall, {TOOL_SANDBOX.cpu_s} s CPU, "
              f"{TOOL_SANDBOX.processes} processes, {TOOL_SANDBOX.output_bytes} B output):")
        for name, command in HOSTILE.items():
            call = '<tool_call>\n{"name": "bash", "arguments": {"command": ' + json.dumps(command) + "}}\n</tool_call>"
            started = time.perf_counter()
            (trajectory,) = run_episodes(scripted([task], lambda t: call, lambda t, text: "went on"), tokenizer, env,
                                         [task], params, token_budget=1 << 20)
            seconds = time.perf_counter() - started
            result = trajectory.turns[0].results[0]
            head = " ".join(result.content.split())[:90]
            print(f"  {name:34s} -> {result.error or 'ok':12s} {seconds:5.2f} s, then {trajectory.finish!r} "
                  f"({len(trajectory.turns)} turns); reads: {head}")
        print(f"  files outside after the writes: /escape {os.path.exists('/escape')}, "
              f"/etc/escape {os.path.exists('/etc/escape')}")


if __name__ == "__main__":
    main()
