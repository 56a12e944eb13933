"""The server's metrics: its counters (`Metrics`), the middleware that counts responses by route and status, and
their rendering in Prometheus' text exposition format (what `GET /metrics` returns)."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any

from hybridtron.infer.scheduler import EngineStats

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")  # others count as "other"


@dataclass
class Metrics:
    """The server's counters (the engine's own come from `engine.stats()`)."""

    responses: collections.Counter = field(default_factory=collections.Counter)  # (route, status) -> count
    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests_finished: collections.Counter = field(default_factory=collections.Counter)  # finish_reason -> count
    request_seconds: float = 0.0
    requests_timed: int = 0
    first_token_seconds: float = 0.0
    first_tokens: int = 0
    timeouts: int = 0
    rejected_queue_full: int = 0

    def render(self, stats: EngineStats) -> str:
        """Prometheus' text exposition format (version 0.0.4): each family's HELP and TYPE lines, then its samples;
        a summary's samples are `<name>_sum` and `<name>_count`; label values and help texts escaped."""
        families = MetricFamilies()
        families.add("http_responses_total", "counter", "HTTP responses by route and status",
                     [({"route": route, "status": status}, count)
                      for (route, status), count in sorted(self.responses.items())])
        families.add("requests_finished_total", "counter", "completions (choices) finished, by finish reason",
                     [({"finish_reason": reason}, count) for reason, count in sorted(self.requests_finished.items())])
        families.add("prompt_tokens_total", "counter", "prompt tokens of served requests", [({}, self.prompt_tokens)])
        families.add("generation_tokens_total", "counter", "tokens generated for served requests",
                     [({}, self.completion_tokens)])
        families.add_summary("request_seconds", "request latency, from arrival to the last token",
                             self.request_seconds, self.requests_timed)
        families.add_summary("time_to_first_token_seconds", "from a request's arrival to its first token",
                             self.first_token_seconds, self.first_tokens)
        families.add("request_timeouts_total", "counter", "requests cancelled by --request-timeout",
                     [({}, self.timeouts)])
        families.add("queue_full_total", "counter", "requests refused with 503: the engine's queue was full",
                     [({}, self.rejected_queue_full)])
        acceptance = stats.mean_acceptance_length
        for name, help_text, value in (
            ("engine_requests_served_total", "sequences the engine finished, for any reason", stats.requests_served),
            ("engine_requests_running", "sequences decoding in a slot or being prefilled", stats.requests_running),
            ("engine_queue_length", "sequences waiting for a slot", stats.queue_length),
            ("engine_slots", "sequences that can decode at once", stats.slots),
            ("engine_slots_used", "slots holding a sequence", stats.slots_used),
            ("engine_batch_occupancy", "slots used / slots", stats.batch_occupancy),
            ("engine_tokens_per_second", "generated tokens per second, last 10 s", stats.tokens_per_second),
            ("engine_mean_acceptance_length", "tokens per speculative verification step, last 10 s (NaN: none)",
             math.nan if acceptance is None else acceptance),
            ("engine_draft_length", "MTP drafts per step in the last step (0: plain decoding)", stats.draft_length),
            ("engine_cache_bytes", "KV cache and SSM state memory allocated", stats.cache_bytes),
            ("engine_prompt_tokens_total", "prompt tokens the engine prefilled", stats.prompt_tokens),
            ("engine_generated_tokens_total", "tokens the engine generated", stats.generated_tokens),
        ):
            families.add(name, "counter" if name.endswith("_total") else "gauge", help_text, [({}, value)])
        return families.text()


class MetricFamilies:
    """Lines of Prometheus' text format, every name prefixed `hybridtron_`. Counters keep the `_total` suffix in
    their family name, as the Go client writes them (the text format's parsers accept both spellings)."""

    def __init__(self):
        self.lines: list[str] = []

    def add(self, name: str, kind: str, help_text: str, samples) -> None:
        """A counter or gauge family: `samples` are (labels, value) pairs."""
        self.header(name, kind, help_text)
        for labels, value in samples:
            self.sample(name, labels, value)

    def add_summary(self, name: str, help_text: str, total: float, count: int) -> None:
        """A summary without quantiles: the sum of the observations and their count."""
        self.header(name, "summary", help_text)
        self.sample(f"{name}_sum", {}, total)
        self.sample(f"{name}_count", {}, count)

    def header(self, name: str, kind: str, help_text: str) -> None:
        help_text = help_text.replace("\\", "\\\\").replace("\n", "\\n")
        self.lines.extend([f"# HELP hybridtron_{name} {help_text}", f"# TYPE hybridtron_{name} {kind}"])

    def sample(self, name: str, labels: dict[str, Any], value: float) -> None:
        label_text = ",".join(f'{key}="{escape_label_value(str(label))}"' for key, label in labels.items())
        self.lines.append(f"hybridtron_{name}{{{label_text}}} {sample_value(value)}" if labels
                          else f"hybridtron_{name} {sample_value(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def escape_label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def sample_value(value: float) -> str:
    """A sample's value as the format spells it: integers as they are, NaN and +Inf / -Inf by name."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class CountResponses:
    """ASGI middleware: counts every response by route and status (for /metrics)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = next((r for r in ROUTES if path == r or path.startswith(r + "/")), "other")

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.responses[route, message["status"]] += 1
            await send(message)

        await self.app(scope, receive, counting_send)
