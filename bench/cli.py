"""Command-line checks the benchmarks share: counts that must be positive, and output paths
checked before a run rather than after it (a run can take an hour)."""

from __future__ import annotations

import argparse
from pathlib import Path


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count")
    return value


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is below 0")
    return value


def non_negative_number(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number at or above 0")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def check_output_dirs(parser: argparse.ArgumentParser, *paths: Path | None) -> None:
    """Refuse an output file whose directory does not exist, before anything runs."""
    for path in paths:
        if path is not None and not path.parent.is_dir():
            parser.error(f"{path}: its directory {path.parent} does not exist")
