"""Every shipped serve config is one the application accepts, with the policy it names."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from app.builder import AppArgs

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [REPO_ROOT / "serve_config.yaml", *sorted((REPO_ROOT / "configs").glob("*.yaml"))]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_a_shipped_config_validates_as_the_builder_reads_it(path: Path) -> None:
    """A typo in a config's args (a field the builder does not know, a tier deeper than the
    engine's kmax, a policy setting out of range) fails here, not at `serve run`."""
    applications = yaml.safe_load(path.read_text())["applications"]
    assert applications, path
    for application in applications:
        args = AppArgs.model_validate(application.get("args", {}))
        assert args.policy["name"], path
        assert all(k <= args.engine.effective_kmax for k in args.candidates)


def test_the_draft_model_config_differs_from_the_default_only_in_drafter_and_profile() -> None:
    """`configs/cpu-draft-model.yaml` is benchmarked against the default: the same app but
    for what a draft model changes, so its results compare drafters and nothing else."""
    def args_of(path: Path) -> dict:
        return yaml.safe_load(path.read_text())["applications"][0]["args"]

    default = args_of(REPO_ROOT / "serve_config.yaml")
    draft = args_of(REPO_ROOT / "configs" / "cpu-draft-model.yaml")
    assert draft["engine"].pop("drafter") == "draft_model"
    assert default["engine"].pop("drafter") == "ngram"
    assert draft["policy"].pop("profile") != default["policy"].pop("profile")
    assert draft == default
