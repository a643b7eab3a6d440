"""OpenTelemetry tracing and metrics for specserve; one table of metric names.

- `observability.metrics`: `METRICS` (the table), `ReplicaMetrics`, `RequestMetrics`.
- `observability.exposition`: `render_prometheus(*snapshots)`, `merge_snapshots`, `CONTENT_TYPE`.
- `observability.tracing`: `configure_tracing`, span helpers, context propagation.
- `observability.per_position`: `accumulate`, per-position counts summed (also the hub's).

Used by app/ and replicas/; imports none of them at run time.
"""
