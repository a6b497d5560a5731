"""In-process vLLM (`vllm.LLM`) for the worker-extension tests: the engine arguments with the
test extension, the RPC helpers that check every rank's report, the controller's sleep and
wake as one cycle. Imported by the tests (tests/worker_ext/conftest.py sets the environment
first and puts this folder on the path)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

from controller import protocol

EXT = "hsext.HotSwapTestExtension"
ENGINE_ARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "enforce_eager": True,
    "max_model_len": 256,
    "seed": 0,
    "worker_extension_cls": EXT,
}


@contextlib.contextmanager
def engine_env(**env: str) -> Iterator[None]:
    """Set env vars for one engine's start (vLLM caches its env once an engine runs)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import vllm.envs as venvs

        if hasattr(venvs, "disable_envs_cache"):
            venvs.disable_envs_cache()
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker_classes() -> list[type[Any]]:
    """The worker classes an in-process engine may grow: vLLM mixes the worker extension into
    the worker class's own bases (`worker_extension_cls`), once per process."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    from worker_ext import sleepworker

    return [CPUWorker, sleepworker.worker_class("cpu")]


@contextlib.contextmanager
def worker_bases_kept() -> Iterator[None]:
    """The worker classes' bases as they were before the block: an engine started with the
    test extension leaves it in CPUWorker's bases, and a later engine with
    `worker_ext.HotSwapWorker` (a CPUWorker) then inherits it and vLLM refuses the extension
    as a conflict; so every engine starts from the same classes whatever ran before it."""
    classes = _worker_classes()
    kept = [(cls, cls.__bases__) for cls in classes]
    try:
        yield
    finally:
        for cls, bases in kept:
            cls.__bases__ = bases


@contextlib.contextmanager
def in_process_llm(
    model: str | os.PathLike[str],
    *,
    env: dict[str, str] | None = None,
    plant: float | None = None,
    **args: Any,
) -> Iterator[Any]:
    """A `vllm.LLM` with the test extension (ENGINE_ARGS, then `args`), started under `env`
    (default: one process), the test scale planted when `plant` is given; always shut down."""
    with worker_bases_kept():
        with engine_env(**{"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}):
            from vllm import LLM

            engine = LLM(model=str(model), **{**ENGINE_ARGS, **args})
        try:
            if plant is not None:
                ok(engine, "hotswap_test_plant", plant)
            yield engine
        finally:
            shutdown(engine)


def generate(
    llm: Any, prompt: list[int] | None = None, n: int = 8
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs (deterministic on CPU with seed 0)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(
        max_tokens=n, temperature=0.0, detokenize=False, logprobs=0, ignore_eos=True
    )
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt or [1, 5, 6, 7, 8, 9])], sp, use_tqdm=False
    )[0].outputs[0]
    lps = [next(iter(d.values())).logprob for d in out.logprobs]
    return list(out.token_ids), lps


def rpc(llm: Any, method: str, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    res = llm.collective_rpc(method, args=args, kwargs=kwargs)
    assert isinstance(res, list), res
    assert all(isinstance(r, dict) for r in res), res
    for r in res:
        assert {"ok", "rank", "elapsed_s"} <= set(r), r
        if not r["ok"]:
            assert isinstance(r.get("error"), str), r
            assert r["error"], r
    return res


def ok(llm: Any, method: str, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    res = rpc(llm, method, *args, **kwargs)
    assert all(r["ok"] for r in res), res
    return res


# After each pool comes back, `poison` overwrites it where a wake must have restored it.
_POISON_AFTER = {protocol.RESUME_WEIGHTS.phase: "weights", protocol.RESUME_KV.phase: "kv_cache"}
# The keys the tests read rank 0's reports by.
_KEY = {
    protocol.RESUME_WEIGHTS.phase: "resume_w",
    protocol.RESUME_KV.phase: "resume_kv",
    protocol.VERIFY.phase: "verify",
}


def cycle(llm: Any, level: int, poison: bool = False, timeout_s: float = 10.0) -> dict[str, Any]:
    """The controller's sleep+wake RPCs (controller.protocol's steps, in their order);
    returns rank 0's reports: quiesce, prepare, suspend, resume_w, [reload], resume_kv,
    verify."""
    llm.reset_prefix_cache()  # the controller's pause(clear_cache=true): KV is about to go
    params = protocol.Params(level=level, quiesce_timeout_s=timeout_s)
    rep: dict[str, Any] = {}
    for step in (*protocol.sleep_steps(level), *protocol.wake_steps(level)):
        rep[_KEY.get(step.phase, step.phase)] = ok(llm, step.method, *step.call_args(params))[0]
        if poison and step.phase in _POISON_AFTER:
            ok(llm, "hotswap_test_poison", [_POISON_AFTER[step.phase]], level)
    return rep


def shutdown(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


# In-process vLLM trips deprecation shims of its dependencies (not ours) while starting.
VLLM_WARNINGS = [
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]
