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


def engine_deployment(args: dict):
    """The engine-replica deployment the builder binds under the ingress."""
    from app.builder import build_app

    return build_app(args)._bound_deployment.init_args[0]._bound_deployment


def test_the_gpu_preset_reserves_its_tensor_parallel_gpus_for_each_replica() -> None:
    """Two replicas on one GPU each, not both on GPU 0 (nor on a node without one)."""
    args = yaml.safe_load((REPO_ROOT / "configs" / "gpu-llama3.1-8b-eagle3.yaml").read_text()
                          )["applications"][0]["args"]
    assert engine_deployment(args).ray_actor_options["num_gpus"] == \
        AppArgs.model_validate(args).engine.tensor_parallel_size
    assert engine_deployment({"engine": {"engine": "sim"}}).ray_actor_options["num_gpus"] == 0


@pytest.mark.parametrize("limit", [0, -2])
def test_a_queue_limit_serve_would_refuse_at_deploy_is_refused_with_the_args(limit) -> None:
    with pytest.raises(ValueError, match="-1 \\(no limit\\) or at least 1"):
        AppArgs.model_validate({"max_queued_requests": limit})
    assert AppArgs.model_validate({"max_queued_requests": -1}).max_queued_requests == -1


@pytest.mark.parametrize(("args", "reason"), [
    ({"policy": {"name": "static", "k": 2}}, "not one of the candidate tiers"),
    ({"stream_interval_ms": float("inf")}, "milliseconds >= 0"),
    ({"engine": {"engine": "sim", "sim_preset": "cpu-dmeo"}}, "unknown simulator preset"),
    ({"engine": {"engine": "sglang", "drafter": "ngram"}}, "needs drafter eagle or eagle3"),
    ({"engine": {"drafter": "eagle3"}}, "needs drafter_model"),
    ({"engine": {"engine": "sglang", "drafter": "eagle3", "drafter_model": "/d"},
      "policy": {"name": "stability"}}, "the sglang engine does not report"),
])
def test_args_every_replica_would_refuse_are_refused_before_anything_deploys(args, reason
                                                                               ) -> None:
    """Each of these passed the builder once and then failed in every replica's constructor
    (on vLLM after its engine had started), and Serve retried the replicas."""
    with pytest.raises(ValueError, match=reason):
        AppArgs.model_validate(args)


def test_a_policy_that_reads_requests_is_built_on_every_engine_that_reports_them() -> None:
    for engine in ({"engine": "vllm"}, {"engine": "sim"}):
        assert AppArgs.model_validate({"engine": engine, "policy": {"name": "stability"}})


def test_mtp_drafts_from_the_target_checkpoint_unless_given_one() -> None:
    """vLLM's mtp takes its draft layers from the target when no draft model is named."""
    assert AppArgs.model_validate({"engine": {"drafter": "mtp"}}).engine.drafter_checkpoint() \
        is None
    assert AppArgs.model_validate({"engine": {"drafter": "mtp", "drafter_model": "/m"}}
                                  ).engine.drafter_checkpoint() == "/m"
