"""`GET /metrics` in Prometheus text format (prometheus_client, one registry per server, nothing global).

- Latency histograms, observed on the event loop from the engine thread's timestamps: time to first token
  (arrival to the first token's step), inter-token latency (between a request's steps, per token) and
  end-to-end (arrival to the last token).
- The scheduler's own figures, from the engine thread's clock (runtime/engine_loop.py): queue time (submit to
  the step that admitted the request) and prefill time (that step's start to the end of the step that gave
  the first token), as vLLM's `request_queue_time_seconds` / `request_prefill_time_seconds`. TTFT less these
  two is what the HTTP side and the hand-offs between threads cost.
- Counters: prompt and generated tokens, requests by finish reason.
- Read from the engine loop's figures at scrape time: requests running and waiting, KDA slots and MLA blocks
  held by sequences (0 when idle), blocks and snapshots held by the prefix cache alone, prompt tokens taken
  from the cache against those admitted (the hit rate), and drafts accepted against drafted (speculation).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)

GAUGES = {"running": ("k3x_requests_running", "Requests holding a slot"),
          "waiting": ("k3x_requests_waiting", "Requests submitted and not yet admitted"),
          "kda_slots": ("k3x_kda_slots_in_use", "Linear-attention state slots held by sequences"),
          "mla_blocks": ("k3x_mla_blocks_in_use", "MLA latent blocks held by sequences"),
          "cache_blocks": ("k3x_prefix_cache_blocks", "MLA latent blocks held by the prefix cache alone"),
          "cache_snapshots": ("k3x_prefix_cache_snapshots", "Linear-attention state snapshots held by the prefix cache")}
COUNTERS = {"prompt_tokens": ("k3x_prefix_cache_queries", "Prompt tokens admitted (prefix-cache lookups)"),
            "cached_tokens": ("k3x_prefix_cache_hits", "Prompt tokens restored from the prefix cache"),
            "drafted": ("k3x_spec_decode_draft_tokens", "Draft tokens verified (speculation)"),
            "accepted": ("k3x_spec_decode_accepted_tokens", "Draft tokens accepted (speculation)"),
            "steps": ("k3x_steps", "Serving steps run")}


class _EngineFigures:
    def __init__(self, loop) -> None:
        self.loop = loop

    def collect(self):
        stats = self.loop.stats
        for key, (name, doc) in GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=stats.get(key, 0))
        for key, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))


class Metrics:
    def __init__(self, loop) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("k3x_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("k3x_inter_token_latency_seconds", "Between a request's tokens", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("k3x_e2e_request_latency_seconds", "Arrival to last token", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.queue_time = Histogram("k3x_request_queue_time_seconds", "Submit to the step that admitted it",
                                    registry=r, buckets=LATENCY_BUCKETS)
        self.prefill_time = Histogram("k3x_request_prefill_time_seconds",
                                      "Admission step's start to the end of the first token's step", registry=r,
                                      buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter("k3x_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("k3x_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("k3x_requests", "Requests ended, by finish reason", ["finish_reason"], registry=r)
        r.register(_EngineFigures(loop))

    def text(self) -> bytes:
        return generate_latest(self.registry)
