"""What /metrics reports: request counters and per-generation histograms, in Prometheus' text
exposition format."""

from __future__ import annotations

import threading

from runtime.api import Model


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{bound:g}"}} {n}' for bound, n in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
HISTOGRAMS = {
    # name: (help, buckets)
    "time_to_first_token_seconds": ("Request arrival to its first generated token.", _SECONDS),
    "time_per_output_token_seconds": ("Decode time per generated token after the first, per request.",
                                      (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)),
    "queue_time_seconds": ("Time a request waited for the engine.", _SECONDS),
    "request_acceptance_alpha": ("Per-token draft acceptance alpha of each speculative request.",
                                 tuple(i / 10 for i in range(1, 11))),
    "request_tokens_per_pass": ("Tokens committed per target pass, per request.", (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)),
}


class Metrics:
    """Counters and histograms for /metrics, in Prometheus' text exposition format."""

    def __init__(self):
        self._lock = threading.Lock()
        self._histograms = {name: Histogram(buckets) for name, (_, buckets) in HISTOGRAMS.items()}
        self._requests: dict[tuple[str, int], int] = {}
        self._cancelled_by_disconnect = 0
        self._seconds_sum = 0.0
        self._seconds_count = 0

    def request(self, endpoint: str, status: int, seconds: float) -> None:
        with self._lock:
            key = (endpoint, status)
            self._requests[key] = self._requests.get(key, 0) + 1
            self._seconds_sum += seconds
            self._seconds_count += 1

    def disconnect(self) -> None:
        with self._lock:
            self._cancelled_by_disconnect += 1

    def generation(self, began: float, first_token_at: float | None, ended: float, result) -> None:
        """One finished generation: began is the request's arrival (perf_counter)."""
        n = len(result.token_ids)
        with self._lock:
            h = self._histograms
            h["queue_time_seconds"].observe(result.timings.get("queue_s", 0.0))
            if first_token_at is not None and n:
                h["time_to_first_token_seconds"].observe(first_token_at - began)
                if n > 1:
                    h["time_per_output_token_seconds"].observe((ended - first_token_at) / (n - 1))
            if result.stats.alpha is not None:
                h["request_acceptance_alpha"].observe(result.stats.alpha)
            if result.stats.target_passes:
                h["request_tokens_per_pass"].observe(result.stats.tokens_per_pass)

    def render(self, model: Model) -> str:
        c = model.counters()
        lines = []

        def metric(name, kind, help_text, samples):
            lines.append(f"# HELP edge_spec_{name} {help_text}")
            lines.append(f"# TYPE edge_spec_{name} {kind}")
            for labels, value in samples:
                label_text = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                lines.append(f"edge_spec_{name}{label_text} {value}")

        with self._lock:
            requests = sorted(self._requests.items())
            disconnects = self._cancelled_by_disconnect
            seconds_sum, seconds_count = self._seconds_sum, self._seconds_count
        metric("http_requests_total", "counter", "HTTP requests answered, by endpoint and status code.",
               [({"endpoint": e, "code": str(s)}, n) for (e, s), n in requests])
        metric("http_request_seconds", "summary", "Time to answer API requests (whole stream included).",
               [])
        lines.append(f"edge_spec_http_request_seconds_sum {seconds_sum:.6f}")
        lines.append(f"edge_spec_http_request_seconds_count {seconds_count}")
        metric("generations_admitted_total", "counter", "Generation requests admitted to the queue.", [({}, c["requests"])])
        metric("generations_rejected_total", "counter", "Generation requests refused because the queue was full.",
               [({}, c["rejected"])])
        metric("generations_queue_timeouts_total", "counter", "Generation requests that waited past the queue timeout.",
               [({}, c["queue_timeouts"])])
        metric("generations_finished_total", "counter", "Generations ended, by stop reason.",
               [({"reason": r}, v) for k, v in sorted(c.items()) if k.startswith("finished_") for r in [k[len("finished_"):]]])
        metric("client_disconnects_total", "counter", "Generations cancelled because the client went away.", [({}, disconnects)])
        metric("prompt_tokens_total", "counter", "Prompt tokens processed.", [({}, c["prompt_tokens"])])
        metric("completion_tokens_total", "counter", "Tokens generated.", [({}, c["completion_tokens"])])
        metric("target_passes_total", "counter", "Target model passes (each verifies a draft block).", [({}, c["target_passes"])])
        metric("drafted_tokens_total", "counter", "Draft tokens proposed.", [({}, c["drafted_tokens"])])
        metric("accepted_tokens_total", "counter", "Draft tokens accepted by the target.", [({}, c["accepted_tokens"])])
        rate = c["accepted_tokens"] / c["drafted_tokens"] if c["drafted_tokens"] else 0.0
        metric("acceptance_rate", "gauge", "Accepted / drafted tokens since start.", [({}, f"{rate:.6f}")])
        metric("queue_depth", "gauge", "Requests waiting for the engine.", [({}, model.queue_depth)])
        metric("queue_capacity", "gauge", "Requests that may wait (--max-queue).", [({}, model.max_queue)])
        metric("generation_running", "gauge", "1 while a generation holds the engine.", [({}, int(model.busy))])
        metric("sequences_running", "gauge", "Requests decoding now (at most --parallel).", [({}, model.running)])
        metric("sequences_parallel", "gauge", "Requests that may decode at once (--parallel).", [({}, model.parallel)])
        with self._lock:
            for name, (help_text, _) in HISTOGRAMS.items():
                lines.append(f"# HELP edge_spec_{name} {help_text}")
                lines.append(f"# TYPE edge_spec_{name} histogram")
                lines.extend(self._histograms[name].lines(f"edge_spec_{name}"))
        return "\n".join(lines) + "\n"
