"""Tiny seeded model folders for tests: config.json, real safetensors, optional tokenizer.

    python -m worker_ext.devmodels OUTDIR [--arch llama|qwen3|gemma3n] [--seed N]
                                   [--tokenizer] [--name NAME]

Imports only torch/transformers/tokenizers (never vllm) so writing a model stays quick.
Shapes satisfy vLLM-CPU: head_dim 32 (its attention's minimum), `architectures` set.
The weights are real and seeded, so a level-2 reload from the checkpoint reproduces them.
`realistic_fill_` draws a tensor's values like a trained model's (for the codec's tests and
benchmarks).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

ARCHES = ("llama", "qwen3", "gemma3n")

HIDDEN = 64
HEADS = 2
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 32: the smallest head size vLLM's CPU attention accepts
INTERMEDIATE = 128
LAYERS = 2
MAX_POSITIONS = 256
VOCAB_PLAIN = 128
VOCAB_TOKENIZER = 320  # byte-level BPE needs 256 byte symbols + specials + a few merges

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<s>", "</s>")
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
_CORPUS = (
    "hello world, this is a tiny tokenizer for tests.",
    "the quick brown fox jumps over the lazy dog 0123456789",
    "sleep, wake, verify: every byte comes back or the model stays out of rotation.",
)


def _config(arch: str, vocab: int) -> Any:
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
    }
    if arch == "llama":
        from transformers import LlamaConfig

        cfg = LlamaConfig(**common)
        cfg.architectures = ["LlamaForCausalLM"]
    elif arch == "qwen3":
        from transformers import Qwen3Config

        cfg = Qwen3Config(head_dim=HEAD_DIM, **common)
        cfg.architectures = ["Qwen3ForCausalLM"]
    elif arch == "gemma3n":
        from transformers import Gemma3nTextConfig

        # Gemma3n's text stack has per-layer inputs, AltUp and LAuReL; keep them minimal.
        cfg = Gemma3nTextConfig(
            head_dim=HEAD_DIM,
            vocab_size_per_layer_input=vocab,
            hidden_size_per_layer_input=16,
            num_kv_shared_layers=0,
            altup_num_inputs=2,
            laurel_rank=8,
            layer_types=["sliding_attention", "full_attention"][:LAYERS],
            activation_sparsity_pattern=[0.0] * LAYERS,
            sliding_window=64,
            **common,
        )
        cfg.architectures = ["Gemma3nForCausalLM"]
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHES}")
    cfg.dtype = "float32"
    return cfg


def _write_tokenizer(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line for line in _CORPUS for _ in range(40)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIALS[BOS],
        eos_token=SPECIALS[EOS],
        pad_token=SPECIALS[PAD],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def write_tiny_model(
    path: str | Path, arch: str = "llama", seed: int = 0, tokenizer: bool = False
) -> Path:
    """Write a tiny model folder at `path` (created if needed) and return it."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _config(arch, VOCAB_TOKENIZER if tokenizer else VOCAB_PLAIN)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer:
        _write_tokenizer(out, cfg.vocab_size)
    return out


# ----------------------------------------------------------------------------- realistic weights
# vLLM's dummy loader draws uniform values in a fixed small interval, whose exponents are not
# like a trained checkpoint's (the host codec's ratio depends on them). Here every tensor gets
# its own normal distribution with a scale drawn log-uniformly from the range trained linear
# layers show (std 0.005-0.06), 0.1% of its values multiplied by 20 (the outliers trained
# models have), and norm weights drawn around 1 (per-tensor mean 0.1-1.5, spread 5%).
# Deterministic for a seed. Tests and benchmarks both draw them.

STD_RANGE = (0.005, 0.06)
OUTLIER_FRACTION = 1e-3
OUTLIER_SCALE = 20.0


def realistic_fill_(t: Any, name: str, seed: int) -> dict[str, float]:
    """Overwrite floating tensor `t` in place; returns the parameters drawn."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    u = float(torch.rand((), generator=g))
    gd = torch.Generator(device=t.device).manual_seed(seed)
    flat = t.view(-1)
    if "norm" in name:
        mean = 0.1 + 1.4 * u
        flat.copy_(torch.randn(flat.shape, generator=gd, device=t.device) * (0.05 * mean) + mean)
        return {"mean": mean}
    lo, hi = (math.log(x) for x in STD_RANGE)
    std = math.exp(lo + (hi - lo) * u)
    vals = torch.randn(flat.shape, generator=gd, device=t.device, dtype=torch.float32) * std
    n_out = int(flat.numel() * OUTLIER_FRACTION)
    if n_out:
        idx = torch.randint(0, flat.numel(), (n_out,), generator=gd, device=t.device)
        vals[idx] *= OUTLIER_SCALE
    flat.copy_(vals.to(t.dtype))
    return {"std": std}


def realistic_fill_model_(named: Any, seed: int = 0) -> int:
    """Fill every floating parameter of `named` ((name, tensor) pairs); returns bytes."""
    import torch

    n = 0
    with torch.no_grad():
        for i, (name, p) in enumerate(named):
            if p.is_floating_point() and p.numel() and p.is_contiguous():
                realistic_fill_(p.data, name, seed * 100003 + i)
                n += p.numel() * p.element_size()
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker_ext.devmodels", description=__doc__)
    parser.add_argument("outdir", type=Path, help="folder that receives the model folder")
    parser.add_argument("--arch", choices=ARCHES, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", action="store_true", help="also write an offline BPE")
    parser.add_argument("--name", default=None, help="model folder name (default tiny-ARCH)")
    args = parser.parse_args(argv)
    name = args.name or f"tiny-{args.arch}{'-tok' if args.tokenizer else ''}"
    out = write_tiny_model(args.outdir / name, args.arch, args.seed, args.tokenizer)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
