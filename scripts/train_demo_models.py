"""Train the shipped demo models: a small Llama target and a tiny Llama draft.

Both share one byte-level BPE tokenizer and are trained on the Python standard library's
source, which every machine with Python has. Seeded and budgeted in tokens, so a rerun on the
same machine reproduces the checkpoints; on 2 idle CPU cores the default budget takes ~17 minutes.

    python scripts/train_demo_models.py --out models/

writes models/target/ and models/draft/ in Hugging Face Llama format (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a chat template), plus
models/training_report.json with parameter counts and held-out losses.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 4096
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# A plain-text chat format: the models were trained on source code, not on dialogue, so the
# template only has to be stable and easy to copy from (which helps prompt-lookup drafting).
# It writes the BOS the models were trained with itself, as Llama's templates do: chat
# prompts are tokenized without adding special tokens, as vLLM's server tokenizes them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "### {{ message['role'] }}\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}### assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    train_tokens: int
    learning_rate: float


# vLLM's CPU attention kernels need head_dim in {32, 64, 80, 96, 112, 128, ...}: both use 32.
# The draft gets a small budget on purpose: a draft far weaker than its target, as in real
# deployments (with equal budgets this 0.7M-parameter model out-learns the 6M target early on).
TARGET = ModelShape(hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
                    intermediate_size=768, train_tokens=2_400_000, learning_rate=2e-3)
DRAFT = ModelShape(hidden_size=128, num_hidden_layers=1, num_attention_heads=4,
                   intermediate_size=384, train_tokens=900_000, learning_rate=3e-3)
CONTEXT = 1024  # max_position_embeddings: serving context, larger than the training window
TRAIN_WINDOW = 256
BATCH = 16


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    return [p for p in files if p.stat().st_size < 400_000]


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


def encode_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)  # starts with BOS
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def build_model(shape: ModelShape, tokenizer: Tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config)


def batches(data: torch.Tensor, generator: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - TRAIN_WINDOW - 1, (BATCH,), generator=generator)
        yield torch.stack([data[s : s + TRAIN_WINDOW + 1] for s in starts.tolist()])


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, data: torch.Tensor, windows: int = 64) -> float:
    model.eval()
    generator = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(windows // BATCH):
        chunk = next(batches(data, generator))
        losses.append(model(input_ids=chunk[:, :-1], labels=chunk[:, :-1]).loss.item())
    model.train()
    return sum(losses) / len(losses)


def train(name: str, shape: ModelShape, tokenizer: Tokenizer, train_data: torch.Tensor,
          val_data: torch.Tensor, seed: int) -> tuple[LlamaForCausalLM, dict]:
    torch.manual_seed(seed)
    model = build_model(shape, tokenizer)
    params = sum(p.numel() for p in model.parameters())
    steps = shape.train_tokens // (BATCH * TRAIN_WINDOW)
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.learning_rate,
                                  betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    generator = torch.Generator().manual_seed(seed)
    started = time.time()
    stream = batches(train_data, generator)
    for step in range(steps):
        chunk = next(stream)
        loss = model(input_ids=chunk, labels=chunk).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            rate = (step + 1) * BATCH * TRAIN_WINDOW / (time.time() - started)
            print(f"[{name}] step {step + 1}/{steps} loss {loss.item():.3f} "
                  f"({rate:.0f} tok/s)", flush=True)
    report = {
        "parameters": params,
        "shape": asdict(shape),
        "train_tokens": steps * BATCH * TRAIN_WINDOW,
        "held_out_loss": round(held_out_loss(model, val_data), 4),
        "train_seconds": round(time.time() - started, 1),
    }
    print(f"[{name}] done: {report}", flush=True)
    return model, report


def save(model: LlamaForCausalLM, tokenizer: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=CONTEXT, chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out)
    # Name the class and embed the template the way older transformers releases read them too.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    # The generation config would otherwise carry transformers' sampling defaults into vLLM.
    (out / "generation_config.json").unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=["target", "draft"],
                        default=["target", "draft"], help="which checkpoints to (re)train")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply both token budgets (0.05 for a smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)

    files = corpus_files()
    random.Random(args.seed).shuffle(files)
    held_out = max(1, len(files) // 50)
    train_texts, val_texts = read_texts(files[held_out:]), read_texts(files[:held_out])
    print(f"corpus: {len(train_texts)} train files, {len(val_texts)} held-out files "
          f"(Python {sys.version.split()[0]} stdlib)", flush=True)
    tokenizer = train_tokenizer(train_texts)
    train_data = encode_stream(tokenizer, train_texts)
    val_data = encode_stream(tokenizer, val_texts)
    print(f"tokens: {len(train_data)} train, {len(val_data)} held-out", flush=True)

    reports = {"corpus_train_tokens": len(train_data), "corpus_held_out_tokens": len(val_data)}
    for name, shape, seed in (("target", TARGET, args.seed), ("draft", DRAFT, args.seed + 1)):
        if name not in args.models:
            continue
        scaled = ModelShape(**{**asdict(shape),
                               "train_tokens": int(shape.train_tokens * args.scale)})
        model, reports[name] = train(name, scaled, tokenizer, train_data, val_data, seed)
        save(model, tokenizer, args.out / name)
    report_path = args.out / "training_report.json"
    if report_path.exists():  # keep the figures of checkpoints not retrained this time
        reports = {**json.loads(report_path.read_text()), **reports}
    report_path.write_text(json.dumps(reports, indent=2) + "\n")


if __name__ == "__main__":
    main()
