"""Tracing's overhead on appends, paired: `bench.eventlog`'s append benchmarks with tracing off and on, alternated
in one process, so that the machine's load weighs on both alike (two whole `bench.eventlog` runs on a busy 2-core
machine differ by more than the effect measured). Also this process's CPU time per event (the SDK's work, its
export thread's included, is all in this process; nats-server's is not), which other processes' load moves less.

    python -m bench.tracing              # 5 rounds
    python -m bench.tracing --rounds 9

Modes: ``off`` (no provider: the default); ``on``: the SDK's TracerProvider with its default sampler
(parentbased_always_on), a BatchSpanProcessor (default settings) and the OTLP/HTTP exporter, sending to a sink
process that answers 200, the appends made outside any trace (as `bench.eventlog`'s: they start none); ``in_trace``:
the same with the appends made inside a sampled trace, so that each makes its publish span (the cost of a traced
append). Replay and restart make no span, so they are not measured here (`bench.eventlog` measures them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.util._once import Once

from bench.eventlog import append_batched, append_one_at_a_time
from shared.natsd import free_port
from shared.telemetry import span

MODES = ("off", "on", "in_trace")

SINK = textwrap.dedent("""
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
        def log_message(self, *a): pass
    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def tracing(on: bool, endpoint: str) -> TracerProvider | None:
    """Install a provider (on) or none (off): the global is reset as opentelemetry's own tests do."""
    trace._TRACER_PROVIDER = None
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    if not on:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": "gpuorch-bench"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")))
    trace.set_tracer_provider(provider)
    return provider


async def main(rounds: int, endpoint: str) -> dict[str, dict[str, float]]:
    sizes = {"one_at_a_time": 2000, "batched": 20_000}
    rates: dict[str, dict[str, list[float]]] = {k: {m: [] for m in MODES} for k in sizes}
    cpu: dict[str, dict[str, list[float]]] = {k: {m: [] for m in MODES} for k in sizes}  # µs per event
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for mode in MODES[r % 3:] + MODES[:r % 3]:  # none always goes first
                provider = tracing(mode != "off", endpoint)
                for kind, bench in (("one_at_a_time", append_one_at_a_time), ("batched", append_batched)):
                    c0 = time.process_time()
                    with span("bench") if mode == "in_trace" else contextlib.nullcontext():
                        rates[kind][mode].append(await bench(Path(tmp) / f"{r}{mode}{kind}", sizes[kind], False))
                    if provider is not None:
                        provider.force_flush()  # its export's cost counts in this block
                    cpu[kind][mode].append((time.process_time() - c0) / sizes[kind] * 1e6)
                if provider is not None:
                    provider.shutdown()
            print(f"round {r + 1}: " + "  ".join(f"{k} " + " ".join(f"{m} {v[m][-1]:,.0f}/s" for m in MODES)
                                                  for k, v in rates.items()), flush=True)
    tracing(False, endpoint)
    med = statistics.median
    return {k: {**{m: med(v[m]) for m in MODES}, **{f"{m}_vs_off": med(v[m]) / med(v["off"]) for m in MODES[1:]},
                **{f"cpu_us_{m}": med(cpu[k][m]) for m in MODES}} for k, v in rates.items()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    port = free_port()
    sink = subprocess.Popen([sys.executable, "-c", SINK, str(port)])
    try:
        result = asyncio.run(main(args.rounds, f"http://127.0.0.1:{port}"))
    finally:
        sink.terminate()
        sink.wait()
    for k, v in result.items():
        print(f"{k}: " + "  ".join(f"{m} {v[m]:,.0f}/s" for m in MODES) + "  " +
              "  ".join(f"{m}/off {v[m + '_vs_off']:.3f}" for m in MODES[1:]) + "  cpu µs/event " +
              " ".join(f"{m} {v['cpu_us_' + m]:.1f}" for m in MODES))
