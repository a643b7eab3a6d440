"""Where the demo draft model agrees with the demo target, token by token, on the greedy
prompts, and what each speculation depth then lands: the ground truth behind the
simulator's `cpu-demo-draft` request types.

Under greedy decoding the output is the target's greedy text whatever K is, and a draft at
any position of a step is the draft model's greedy token after the text so far (the drafts
before it landed). So one pass of each model gives, per output position, whether the draft
model's token there matches the target's (its agreement), and the whole step process follows
at every depth: a step lands drafts until the first mismatch or K, then adds the target's
token (a correction, or a bonus no draft was checked against), and the next step starts
after it. A shallow tier's bonus tokens skip the positions a deep one drafts, so what the
first position lands depends on the depth: on "import os" lines the draft model agrees at two
positions of every three, and lands the first draft of half the steps at K=1 but of 90% at
K=3.

    python -m bench.greedy_agreement --markdown bench/results/greedy_agreement.md \
        --json replicas/engines/cpu_demo_draft_agreement.json

The JSON (each prompt's agreement string) is what the simulator's preset replays.

Runs the models with Hugging Face transformers on the CPU (float32, as the vLLM-CPU engine
runs them); acceptance lengths agree with the HTTP benchmark's statics (static1 and static3 in
the high phases) within 1%.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.workloads import HIGH
from replicas.engines.sim_presets import step_runs

MODELS = Path(__file__).resolve().parents[1] / "models"
TARGET, DRAFT = MODELS / "target", MODELS / "draft"
DEPTHS = (1, 3, 7, 15)
MAX_TOKENS = 256


@dataclass
class PromptAgreement:
    prompt: str
    agreement: str
    """'1' where the draft model's greedy token matches the target's, per output position."""
    first_rate: dict[int, float]
    """Per depth, the share of steps that land their first draft."""
    tokens_per_step: dict[int, float]


def agreements(max_tokens: int = MAX_TOKENS) -> list[PromptAgreement]:
    """Each HIGH prompt's agreement over the target's first `max_tokens` greedy tokens, and
    its steps at each depth in `DEPTHS`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()
    results = []
    for prompt in HIGH:
        ids = tokenizer(prompt.text, return_tensors="pt").input_ids
        with torch.no_grad():
            text = target.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                   min_new_tokens=max_tokens)[0]
            # The draft model's greedy token after each prefix of the text, in one pass.
            predicted = draft(text[None]).logits[0].argmax(-1)
        start = ids.shape[1]
        agreement = "".join("1" if predicted[t - 1] == text[t] else "0"
                            for t in range(start, len(text)))
        runs = {k: step_runs(agreement, k) for k in DEPTHS}
        results.append(PromptAgreement(
            prompt.text.splitlines()[0] if "\n" in prompt.text else prompt.text[:12],
            agreement,
            {k: float(np.mean([run > 0 for run in r])) for k, r in runs.items()},
            {k: 1 + float(np.mean(r)) for k, r in runs.items()}))
    return results


def report(results: list[PromptAgreement]) -> str:
    tokens = len(results[0].agreement) if results else 0
    lines = ["### GREEDY AGREEMENT OF THE DEMO DRAFT MODEL WITH THE TARGET (the HIGH prompts, "
             f"{tokens} tokens each; first-draft rate and tokens a step at each depth)", "",
             "| prompt | agreement | " + " | ".join(
                 f"K={k} first / tokens" for k in DEPTHS) + " |",
             "|---" * (2 + len(DEPTHS)) + "|"]
    for r in results:
        cells = " | ".join(f"{r.first_rate[k]:.2f} / {r.tokens_per_step[k]:.2f}"
                           for k in DEPTHS)
        lines.append(f"| `{r.prompt!r}` | {r.agreement.count('1') / len(r.agreement):.2f} | "
                     f"{cells} |")
    # The phase as a whole: each request's tokens over the steps all of them take.
    pooled, all_tokens = [], sum(len(r.agreement) for r in results)
    for k in DEPTHS:
        steps = _steps(results, k)
        first = sum(s * r.first_rate[k] for s, r in zip(steps, results, strict=True))
        pooled.append(f"{first / sum(steps):.2f} / {all_tokens / sum(steps):.2f}")
    lines.append(f"| all (steps pooled) | | {' | '.join(pooled)} |")
    return "\n".join(lines) + "\n"


def _steps(results: list[PromptAgreement], k: int) -> list[float]:
    """Each request's steps at depth k: its tokens over its tokens a step."""
    return [len(r.agreement) / r.tokens_per_step[k] for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = agreements(args.max_tokens)
    text = report(results)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
