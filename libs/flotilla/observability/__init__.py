"""Observability shared by every Flotilla service: Prometheus metric definitions and the exposition server,
OpenTelemetry tracing set-up, trace-context propagation in gRPC metadata, and the per-request JSON log."""
