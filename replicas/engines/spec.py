"""How to build an engine: one validated spec for every adapter (vLLM, SGLang, simulator)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from replicas.engines.sim_presets import PRESETS

REPO_ROOT = Path(__file__).resolve().parents[2]
# Set in every engine process before anything reads it: Hugging Face's hub client and vLLM
# read theirs at import, before an engine adapter runs. The models are local files; nothing
# reports usage or binds beyond loopback.
LOCAL_ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "VLLM_HOST_IP": "127.0.0.1"}
DEMO_TARGET = str(REPO_ROOT / "models" / "target")
DEMO_DRAFT = str(REPO_ROOT / "models" / "draft")

Drafter = Literal["none", "ngram", "draft_model", "eagle", "eagle3", "mtp"]
"""`none` builds the engine without speculation: the plain-decoding baseline (only K=0)."""
SGLANG_ALGORITHMS = {"eagle": "EAGLE", "eagle3": "EAGLE3"}
"""The drafters SGLang's adaptive tiers support, by SGLang's name for each."""


class EngineSpec(BaseModel):
    """Everything an engine adapter needs. Paths default to the shipped demo models."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["vllm", "sglang", "sim"] = "vllm"
    """`sim` is the simulator engine (policy studies, fast tests), never a real model;
    `sglang` needs a CUDA GPU and an eagle/eagle3 drafter."""
    model: str = DEMO_TARGET
    served_model_name: str | None = None
    drafter: Drafter = "ngram"
    drafter_model: str | None = None
    """Checkpoint for draft_model / eagle / eagle3 drafters (the demo draft for draft_model);
    for mtp, None drafts with the target checkpoint's own MTP layers, as vLLM does."""
    kmax: int = Field(15, ge=1, le=64)
    """Largest K the engine is built for; every candidate tier must be <= kmax."""
    tiers: tuple[int, ...] = ()
    """Candidate K values to prepare for at start-up (CUDA graphs per verify length on GPU);
    empty prepares kmax only. The app fills it from the tier pool's candidates."""
    prompt_lookup_min: int = Field(2, ge=1)
    prompt_lookup_max: int = Field(5, ge=1)
    max_model_len: int = Field(1024, ge=16)
    max_num_seqs: int = Field(64, ge=1)
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    seed: int = 0
    enforce_eager: bool = False
    """Skip torch.compile / graph capture: starts ~2x faster, steps ~30% slower on CPU."""
    kv_cache_memory_bytes: int | None = 256 * 2**20
    """KV cache size on CPU. vLLM's `VLLM_CPU_KVCACHE_SPACE` (GiB), when the environment sets
    it, overrides it; None leaves the size to that variable, 1 GiB when it is unset."""
    cpu_threads: int | None = None
    """OMP threads per engine on CPU; None binds one core per replica rank."""
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    sim_preset: str = "cpu-demo"
    """Simulator calibration preset (engine: sim only)."""
    sim_time_scale: float = Field(1.0, gt=0)
    """Simulator: multiply simulated step times when sleeping in real time."""

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).name

    @property
    def effective_kmax(self) -> int:
        return 0 if self.drafter == "none" else self.kmax

    @property
    def drafts_with_a_model(self) -> bool:
        """A model proposes the drafts (not prompt lookup, and not plain decoding)."""
        return self.drafter not in ("none", "ngram")

    def drafter_checkpoint(self) -> str | None:
        """The drafter's checkpoint; None for prompt lookup, plain decoding, and mtp from the
        target's own layers."""
        if not self.drafts_with_a_model:
            return None
        if self.drafter_model or self.drafter == "mtp":
            return self.drafter_model
        if self.drafter == "draft_model":
            return DEMO_DRAFT
        raise ValueError(f"drafter {self.drafter!r} needs drafter_model (a checkpoint path)")

    @model_validator(mode="after")
    def _engine_can_build(self) -> EngineSpec:
        """Refuse here what an adapter would refuse only once its replica started: the app
        validates its config before it deploys anything (`AppArgs`)."""
        if self.engine == "sglang" and self.drafter not in SGLANG_ALGORITHMS:
            raise ValueError(f"the SGLang adapter needs drafter eagle or eagle3 (SGLang's "
                             f"adaptive tiers support only those), got {self.drafter!r}")
        if self.engine == "sim" and self.sim_preset not in PRESETS:
            raise ValueError(f"unknown simulator preset {self.sim_preset!r}; "
                             f"choose one of {', '.join(PRESETS)}")
        self.drafter_checkpoint()
        return self
