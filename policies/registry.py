"""Build a policy from its name and config (one pydantic schema per policy)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from policies.base import Policy
from policies.batch_table import BatchTableConfig, BatchTablePolicy
from policies.ema import EmaConfig, EmaPolicy
from policies.goodput import GoodputConfig, GoodputPolicy
from policies.stability import StabilityConfig, StabilityPolicy
from policies.static import StaticConfig, StaticPolicy

_CONFIG_MODELS = StaticConfig | BatchTableConfig | EmaConfig | GoodputConfig | StabilityConfig
PolicyConfig = Annotated[_CONFIG_MODELS, Field(discriminator="name")]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(PolicyConfig)
_POLICIES = {
    "static": StaticPolicy,
    "batch_table": BatchTablePolicy,
    "ema": EmaPolicy,
    "goodput": GoodputPolicy,
    "stability": StabilityPolicy,
}
POLICY_NAMES = tuple(_POLICIES)


def parse_policy_config(config: dict[str, Any] | Any) -> Any:
    """A validated config model from `{"name": "ema", ...}`, or an already-built model as it
    is; anything else (a bare name, null, a list) is a ValueError, not a model-less config
    that fails later where it is used."""
    if isinstance(config, _CONFIG_MODELS):
        return config
    if not isinstance(config, dict):
        raise ValueError(f'a policy config is an object such as {{"name": "goodput"}}, not '
                         f"{config!r:.80}")
    name = config.get("name")
    if name not in _POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    try:
        return _ADAPTER.validate_python(config)
    except ValidationError as error:
        raise ValueError(f"invalid {name} policy config: {error}") from error


def build_policy(config: dict[str, Any] | Any, candidates: tuple[int, ...]) -> Policy:
    model = parse_policy_config(config)
    return _POLICIES[model.name](model, tuple(candidates))
