"""GPU tests: real vLLM 0.26 (CUDA) with sleep mode, in-process LLM objects.

Every test here is marked `gpu` and skipped where CUDA or CUDA vLLM is missing, so CPU CI
collects and skips them. On the device run them with benchmarks/run-on-device.sh (it passes
--confcutdir, so the controller-side root conftest and its packages are not needed there).
Each LLM runs its engine in its own process (multiprocessing on): vLLM's CuMemAllocator
allows one sleep-mode engine per process.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from controller import protocol

ROOT = Path(__file__).resolve().parents[2]
# The keys the GPU tests read a wake's reports by.
_WAKE_KEYS = {
    protocol.RESUME_WEIGHTS.phase: "weights",
    protocol.RELOAD.phase: "reload",
    protocol.RESUME_KV.phase: "kv_cache",
    protocol.VERIFY.phase: "verify",
    protocol.RESUME_VERIFY.phase: "verify",  # the fused hotswap_wake: its report has verify's keys
}
EXTENSION = "tests.gpu.gpu_ext.GpuTestExtension"
PROMPT = [2, 5, 9, 12, 7, 3, 11, 4]


def _cuda_vllm() -> str | None:
    """Why GPU tests cannot run here, or None when they can."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("vllm") is None:
        return "torch or vllm not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from vllm.device_allocator.cumem import cumem_available
    except Exception as exc:  # a CPU build of vLLM has no cumem allocator
        return f"vLLM without the cumem allocator: {exc}"
    return None if cumem_available else "vLLM without the cumem allocator"


SKIP_REASON = _cuda_vllm()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.gpu)
            if SKIP_REASON is not None:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


if SKIP_REASON is None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    # This process touches CUDA (skip check, model writing): engines must be spawned.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *(p for p in paths if p != str(ROOT))])
    for key, value in {
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # demotable level-1 sleeps (off by default, on under a host budget): the demote
        # test needs them, and every other test then runs the larger prepare as well
        "HOTSWAP_DEMOTABLE": "1",
    }.items():
        os.environ.setdefault(key, value)


def audit_table(title: str, report: dict[str, Any]) -> str:
    """hotswap_audit(level, detail=True) of one rank as a markdown table."""
    lines = [
        f"### {title}: level {report['level']}, {report['count']} tensors, "
        f"{report['bytes']} bytes, at risk {len(report['at_risk'])} ({report['at_risk_bytes']} B)",
        "",
        "| name | bytes | kind | pool | restored | at_risk |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["tensors"]:
        lines.append(
            f"| {r['name']} | {r['bytes']} | {r['kind']} | {r['pool']} | {r['restored']} "
            f"| {r['at_risk']} |"
        )
    text = "\n".join(lines) + "\n"
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "audit-gpu.md"), "a") as f:
            f.write(text + "\n")
    return text


def write_gemma3n(path: Path) -> Path:
    """The tiny Gemma3n text config of vLLM PR #53344's reproducer (3 layers, the last one
    KV-shared), config only: engines load it with load_format="dummy". A saved HF checkpoint
    does not load in vLLM 0.26 (HF writes no k_norm for a KV-shared layer), so level 2
    here reloads from a host copy of the parameters (GpuTestExtension), not a checkpoint."""
    import transformers

    cfg = transformers.Gemma3nTextConfig(
        architectures=["Gemma3nForCausalLM"],
        vocab_size=128,
        vocab_size_per_layer_input=128,
        hidden_size=64,
        hidden_size_per_layer_input=16,
        intermediate_size=[128, 128, 128],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_kv_shared_layers=1,
        laurel_rank=16,
        activation_sparsity_pattern=[0.0, 0.0, 0.0],
    )
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            if arch == "gemma3n":
                made[arch] = write_gemma3n(out / "model")
            else:
                from worker_ext.devmodels import write_tiny_model

                made[arch] = write_tiny_model(out / "model", arch=arch, seed=0)
        return made[arch]

    return make


class Engine:
    """One in-process LLM and the helpers the tests share."""

    def __init__(self, model: Path, **extra: Any) -> None:
        from vllm import LLM

        kw: dict[str, Any] = {
            "model": str(model),
            "skip_tokenizer_init": True,
            "enable_sleep_mode": True,
            "worker_extension_cls": EXTENSION,
            "max_model_len": 256,
            "gpu_memory_utilization": 0.05,
            "dtype": "bfloat16",
            "seed": 0,
            "max_num_seqs": 8,
            "attention_backend": "TRITON_ATTN",
            "disable_log_stats": True,
            "enforce_eager": True,
        }
        kw.update(extra)
        self.llm = LLM(**kw)

    def gen(self, n: int = 16, prompt: list[int] = PROMPT) -> tuple[list[int], list[float]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1, detokenize=False
        )
        out = self.llm.generate(TokensPrompt(prompt_token_ids=prompt), sp, use_tqdm=False)
        c = out[0].outputs[0]
        lps = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs or [], strict=False)]
        return list(c.token_ids), lps

    def rpc(self, method: str, *args: Any, ok: bool = True) -> dict[str, Any]:
        res = self.llm.collective_rpc(method, args=args)
        assert len(res) == 1
        r: dict[str, Any] = res[0]
        if ok:
            assert r.get("ok"), f"{method}{args}: {json.dumps(r)[:2000]}"
        return r

    def sleep(
        self, level: int, tags: list[str] | None = None, fused: bool = False
    ) -> dict[str, Any]:
        """controller.protocol's sleep steps, in-process: cache cleared (the controller's
        pause does that), quiesce, prepare, suspend (only `tags`' pools, when given);
        `fused`: the controller's default, quiesce then one hotswap_sleep (its report
        under "prepare_and_suspend")."""
        self.llm.reset_prefix_cache()
        params = protocol.Params(
            level=level, quiesce_timeout_s=30.0, tags=tuple(tags) if tags is not None else None
        )
        steps = protocol.sleep_steps(level, fused=fused)
        return {s.phase: self.rpc(s.method, *s.call_args(params)) for s in steps}

    def wake(
        self,
        level: int,
        tags: list[str] | None = None,
        reload: str = "hotswap_reload",
        fused: bool = False,
    ) -> dict[str, Any]:
        """controller.protocol's wake steps for the pools asleep (weights only when `tags`
        allow); `reload` names the level-2 refill RPC; `fused`: the controller's default,
        the last resume and the verify in one hotswap_wake. Reports by pool ("weights",
        "reload", "kv_cache") and "verify" (the fused call's report is under "verify")."""
        asleep = set(self.rpc("hotswap_info")["suspended"])
        if tags is not None and "weights" not in tags:
            asleep.discard("weights")
        steps = protocol.with_method(
            protocol.wake_steps(level, asleep, fused=fused), "reload", reload
        )
        params = protocol.Params(level=level)
        return {_WAKE_KEYS[s.phase]: self.rpc(s.method, *s.call_args(params)) for s in steps}

    def close(self) -> None:
        llm = self.llm
        shutdown = getattr(llm, "shutdown", None) or getattr(
            llm.llm_engine.engine_core, "shutdown", None
        )
        if callable(shutdown):
            shutdown()
        del self.llm, llm
        gc.collect()


@pytest.fixture(scope="module")
def engines() -> Iterator[Callable[..., Engine]]:
    started: list[Engine] = []

    def start(model: Path, **extra: Any) -> Engine:
        e = Engine(model, **extra)
        started.append(e)
        return e

    yield start
    for e in started:
        e.close()
