"""Prometheus text exposition (format 0.0.4) of metric snapshots, merged over processes.

The ingress serves `/metrics` as
`render_prometheus(request_metrics.snapshot(), *replica_snapshots)`: each replica snapshot
already carries its `replica` label, so series of different replicas never collide. Names
unknown to this process's table (a newer replica during a rolling upgrade) are skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from observability.metrics import METRICS, Snapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def merge_snapshots(snapshots: Iterable[Snapshot]) -> Snapshot:
    """Union of snapshots; for the same family and label set the later snapshot wins."""
    merged: dict[str, dict[tuple[tuple[str, str], ...], dict]] = {}
    for snapshot in snapshots:
        for name, samples in snapshot.items():
            family = merged.setdefault(name, {})
            for sample in samples:
                family[tuple(sorted(sample["labels"].items()))] = sample
    return {name: list(family.values()) for name, family in merged.items()}


def render_prometheus(*snapshots: Snapshot) -> str:
    merged = merge_snapshots(snapshots)
    lines: list[str] = []
    for spec in METRICS:  # table order keeps the output stable
        samples = merged.get(spec.name)
        if not samples:
            continue
        lines.append(f"# HELP {spec.name} {_escape_help(spec.help)}")
        lines.append(f"# TYPE {spec.name} {'gauge' if spec.kind == 'info' else spec.kind}")
        for sample in samples:
            labels = sample["labels"]
            if spec.kind != "histogram":
                lines.append(f"{spec.name}{_labels(labels)} {_number(sample['value'])}")
                continue
            for bound, count in zip(sample["bounds"], sample["buckets"], strict=True):
                lines.append(f"{spec.name}_bucket{_labels({**labels, 'le': _number(bound)})} "
                             f"{_number(count)}")
            lines.append(f"{spec.name}_bucket{_labels({**labels, 'le': '+Inf'})} "
                         f"{_number(sample['count'])}")
            lines.append(f"{spec.name}_sum{_labels(labels)} {_number(sample['sum'])}")
            lines.append(f"{spec.name}_count{_labels(labels)} {_number(sample['count'])}")
    return "\n".join(lines) + "\n" if lines else ""


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{_escape_value(str(value))}"' for key, value in labels.items())
    return "{" + inner + "}"


def _escape_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)

