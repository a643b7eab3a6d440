"""Regenerate the README's result tables from `bench/results/*.md`.

    python -m bench.readme_tables          # rewrite README.md in place
    python -m bench.readme_tables --check  # exit 1 if README.md is out of date

A table block in the README is fenced by markers naming the results file and, optionally, the
sections (by title prefix) to take from it:

    <!-- results:policy_replay_h20-llama8b-ngram_transition.md sections=RATIOS -->
    ...generated...
    <!-- /results -->
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

RESULTS = Path("bench/results")
BLOCK = re.compile(r"(<!-- results:(?P<file>[\w.\-]+)(?: sections=(?P<sections>[^>]*?))? -->\n)"
                   r".*?(<!-- /results -->)", re.S)


def sections_of(text: str) -> dict[str, str]:
    """Markdown sections keyed by their `### ` title."""
    parts = re.split(r"(?m)^(?=### )", text)
    return {part.splitlines()[0][4:]: part.strip() for part in parts if part.startswith("### ")}


def render(file: str, sections: str | None) -> str:
    text = (RESULTS / file).read_text().strip()
    if not sections:
        return text
    available = sections_of(text)
    chosen = []
    for prefix in (s.strip() for s in sections.split(",")):
        matches = [body for title, body in available.items() if title.startswith(prefix)]
        if not matches:
            raise SystemExit(f"{file}: no section titled {prefix!r}")
        chosen += matches
    return "\n\n".join(chosen)


def regenerate(readme: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m["file"], m["sections"]) + "\n" + m.group(4),
                     readme)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=Path("README.md"))
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    old = args.readme.read_text()
    new = regenerate(old)
    if args.check:
        sys.exit(0 if new == old else 1)
    args.readme.write_text(new)
    print(f"{args.readme}: {len(BLOCK.findall(old))} result blocks regenerated")


if __name__ == "__main__":
    main()
