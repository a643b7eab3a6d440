"""Command-line checks the benchmarks share: counts that must be positive, output paths
checked before a run rather than after it (a run can take an hour), and modes `--define`d
with a policy config of their own."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.report import is_static
from policies.registry import parse_policy_config


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


def defined_mode(text: str) -> tuple[str, dict[str, Any]]:
    """`NAME=JSON` (a `--define`) -> (NAME, the policy config), checked as the application
    checks one (`POST /admin/policy`), so a typo fails now, not when its mode's turn comes.
    A defined mode counts as adaptive in the report, so it may not be a static one."""
    name, sep, config = text.partition("=")
    if not sep or not name or "," in name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=JSON (NAME without commas)")
    if is_static(name):
        raise argparse.ArgumentTypeError(f"{name!r}: names starting with 'static' are the "
                                         "static tiers")
    try:
        policy = json.loads(config)
        if not isinstance(policy, dict):
            raise ValueError("a policy config is a JSON object")
        if parse_policy_config(policy).name == "static":
            raise ValueError("a static tier is a mode of its own: static<K>")
    except ValueError as error:  # JSON and pydantic errors are ValueErrors
        raise argparse.ArgumentTypeError(f"{name}: {error}") from error
    return name, policy


def defined_modes(definitions: list[tuple[str, dict[str, Any]]], modes: list[str]
                  ) -> dict[str, dict[str, Any]]:
    """The `--define`s by name; each name once, and each a mode that runs."""
    names = [name for name, _ in definitions]
    problems = [f"{name!r} is defined twice" for name in sorted(set(names))
                if names.count(name) > 1]
    problems += [f"{name!r} is defined but not in --modes" for name in sorted(set(names))
                 if name not in modes]
    if problems:
        raise ValueError("; ".join(problems))
    return dict(definitions)
