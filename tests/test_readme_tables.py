"""The README's result tables are their results files', as `make bench` writes them: a table
edited by hand, or a results file changed without the README, fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.readme_tables import BLOCK, regenerate

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def readme(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(ROOT)  # the blocks name files under bench/results
    return (ROOT / "README.md").read_text()


def test_every_result_block_in_the_readme_matches_its_results_file(readme):
    assert len(BLOCK.findall(readme)) >= 10
    assert regenerate(readme) == readme, "run `python -m bench.readme_tables`"


def test_a_table_edited_by_hand_is_put_back(readme):
    row = readme.index("\n|", readme.index("<!-- results:")) + 1
    assert regenerate(readme[:row] + "| edited by hand |\n" + readme[row:]) == readme
