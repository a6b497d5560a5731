"""What the benchmarks share: the model shapes, their configs, greedy generation, timing,
and how an engine (and the sidecar) is launched on the device.

Engines start through controller.engines.launcher's one process-group launcher (`EngineSpec`,
`EngineProcess`): its GPU flags (sleep mode, memory utilization, dtype, dummy weights)
replace the argv the benches used to build by hand.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the launcher imports the controller's settings (pydantic-settings), which
    # the device's in-process benches do not have: imported where an engine is launched
    from controller.engines.enginespec import EngineSpec

__all__ = ["GB", "SHAPES", "UTIL", "GiB", "free_port", "gen", "rss", "timed", "write_config"]

GB = 1e9
GiB = 1 << 30

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": (
        "llama",
        {
            "vocab_size": 1024,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
        },
    ),
    "llama32-1b": (
        "llama",
        {
            "vocab_size": 128256,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
        },
    ),
    "llama32-3b": (
        "llama",
        {
            "vocab_size": 128256,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 28,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
        },
    ),
    "llama3-8b": (
        "llama",
        {
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        },
    ),
    "qwen25-14b": (
        "qwen2",
        {
            "vocab_size": 152064,
            "hidden_size": 5120,
            "intermediate_size": 13824,
            "num_hidden_layers": 48,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
        },
    ),
}
UTIL = {"tiny": 0.05, "llama32-1b": 0.2, "llama32-3b": 0.3, "llama3-8b": 0.45, "qwen25-14b": 0.5}


def weight_bytes(shape: str) -> int:
    """The shape's bf16 weights in bytes, from its config (embeddings, attention with its
    key/value heads, the gated MLP, the norms; the output head unless tied)."""
    _, kw = SHAPES[shape]
    h, inter, layers = kw["hidden_size"], kw["intermediate_size"], kw["num_hidden_layers"]
    kv = h // kw["num_attention_heads"] * kw["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    embed = kw["vocab_size"] * h * (1 if kw.get("tie_word_embeddings") else 2)
    return 2 * (embed + layers * per_layer + h)


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def write_config(shape: str, d: str) -> str:
    import transformers

    fam, kw = SHAPES[shape]
    cls = transformers.LlamaConfig if fam == "llama" else transformers.Qwen2Config
    arch = "LlamaForCausalLM" if fam == "llama" else "Qwen2ForCausalLM"
    cfg = cls(architectures=[arch], **kw)
    cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(d)
    return d


def dummy_engine_kwargs(shape: str, max_model_len: int, **extra: Any) -> dict[str, Any]:
    """An in-process engine's arguments: the shape's config written to a fresh folder,
    dummy bf16 weights, token ids only, seed 0, the hot-swap extension; `extra` on top."""
    d = write_config(shape, tempfile.mkdtemp(prefix=f"{shape}-"))
    return {
        "model": d,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": max_model_len,
        "dtype": "bfloat16",
        "seed": 0,
        "worker_extension_cls": "worker_ext.HotSwapExtension",
        **extra,
    }


def gen(llm: Any, n: int = 16) -> tuple[list[int], list[float]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1, detokenize=False
    )
    out = llm.generate(
        TokensPrompt(prompt_token_ids=[2, 5, 9, 12, 7, 3, 11, 4]), sp, use_tqdm=False
    )
    c = out[0].outputs[0]
    lps = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs or [], strict=False)]
    return list(c.token_ids), lps


def timed(fn: Any, *a: Any, **k: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    r = fn(*a, **k)
    return r, time.perf_counter() - t


def logger(tag: str, *, clock: bool = True) -> Callable[..., None]:
    """`log(...)`: print with the bench's tag (run-on-device.sh keeps lines that start with
    it) and, with `clock`, the seconds since the bench started."""
    t0 = time.monotonic()

    def log(*a: Any) -> None:
        stamp = f"[{tag} {time.monotonic() - t0:6.1f}s]" if clock else f"[{tag}]"
        print(stamp, *a, flush=True)

    return log


def free_port() -> int:
    """A free loopback port (controller.engines.sockets.free_port, imported when asked)."""
    from controller.engines.sockets import free_port as pick

    return pick()


def gpu_engine(
    model: str,
    port: int,
    name: str,
    *,
    util: float,
    extension: str = "worker_ext.HotSwapExtension",
    tensor_parallel_size: int = 1,
    dummy: bool = False,
    max_model_len: int = 2048,
    eager: bool = True,
    env: Mapping[str, str] | None = None,
    kv_bytes: int | None = None,
) -> EngineSpec:
    """A CUDA vLLM OpenAI server with sleep mode and the extension, bf16, token ids only;
    `dummy`: random weights (no checkpoint read); `eager` False: vLLM's default compile and
    CUDA-graph capture (the launcher's argv without `--enforce-eager`); `kv_bytes`: the KV
    cache's size (vLLM's --kv-cache-memory-bytes), not what the utilization leaves after a
    profile that counts every process's allocations on the device (engines booting beside
    it), so it does not depend on them; the utilization is then only vLLM's check of the
    free memory at start."""
    from controller.engines.enginespec import EngineSpec

    spec = EngineSpec(
        model=Path(model),
        port=port,
        served_model_name=name,
        uni=False,  # the engine's own processes, as in production
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_memory_bytes=kv_bytes,  # None: sized by the utilization
        max_model_len=max_model_len,
        worker_extension_cls=extension,
        skip_tokenizer_init=True,
        sleep_mode=True,
        gpu_memory_utilization=util,
        dtype="bfloat16",
        load_format="dummy" if dummy else None,
        max_num_seqs=8,
        extra_env=dict(env or {}),
    )
    if eager:
        return spec
    argv = [a for a in spec.argv() if a != "--enforce-eager"]
    return EngineSpec.from_command(name, argv, port, dict(env or {}))


def sidecar(
    engines: Sequence[tuple[str, str]], port: int, env: Mapping[str, str] | None = None
) -> EngineSpec:
    """`hotswap serve --engine NAME=URL ...` on `port`, launched like an engine (its own
    process group, stopped by group)."""
    from controller.engines.enginespec import EngineSpec

    argv = [sys.executable, "-m", "controller", "serve"]
    for name, url in engines:
        argv += ["--engine", f"{name}={url}"]
    return EngineSpec.from_command("sidecar", argv, port, dict(env or {}))
