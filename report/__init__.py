"""`python -m report TRACE.jsonl [...] [--plots DIR]`: is speculation paying?

Reads the spans the services write (service_common.telemetry, `--trace-exporter jsonl`)
or a live Prometheus /metrics endpoint, and prints acceptance, where a round's time
goes, the measured speedup against target-only decoding, and what the cost model of
Leviathan et al. 2023 predicts: the best k and the round-trip delay at which
speculation stops paying.
"""
