"""Gemma3n through level 2 on a real GPU: vLLM 0.26 alone loses the model's plain-attribute
scale tensors; the extension's sequence brings them, the tokens and the logprobs back.

The model is PR #53344's tiny Gemma3nTextConfig with dummy weights; level 2 refills the
weights from a host copy of the parameters (tests.gpu.gpu_ext), not from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.conftest import Engine, audit_table

pytestmark = pytest.mark.gpu

PROMPT = [2, 5, 9, 12, 7, 3]
RELOAD = "hotswap_test_reload_host"


@pytest.fixture(scope="module")
def gemma3n(model_dir: Callable[[str], Path], engines: Callable[..., Engine]) -> Engine:
    eng = engines(model_dir("gemma3n"), load_format="dummy", max_num_seqs=1)
    eng.rpc("hotswap_test_keep_host_copy")
    return eng


def _scales(eng: Engine) -> dict[str, Any]:
    scales: dict[str, Any] = eng.rpc("hotswap_test_scales")["scales"]
    return scales


def test_gemma3n_audit_table(gemma3n: Engine) -> None:
    rep = gemma3n.rpc("hotswap_audit", 2, True)
    print(audit_table("tiny Gemma3n (GPU, cumem)", rep))
    assert any(n.endswith("embed_scale") for n in rep["at_risk"]), rep["at_risk"]


def test_gemma3n_level2_extension_keeps_scales(gemma3n: Engine) -> None:
    base = gemma3n.gen(prompt=PROMPT)
    assert gemma3n.gen(prompt=PROMPT) == base, "not deterministic before any sleep"
    scales = _scales(gemma3n)
    values = {k.rsplit(".", 1)[-1]: v["value"] for k, v in scales.items()}
    print("scales before:", values)
    assert values.get("embed_scale") == 8.0, scales
    assert values.get("embed_scale_per_layer") == 4.0, scales
    for cycle in range(2):
        s = gemma3n.sleep(2)
        w = gemma3n.wake(2, reload=RELOAD)
        assert w["verify"]["mismatched"] == [], w["verify"]
        assert w["verify"]["verified"] == s["prepare"]["fingerprinted"]
        assert _scales(gemma3n) == scales, f"cycle {cycle}"
        assert gemma3n.gen(prompt=PROMPT) == base, f"cycle {cycle}"


def test_gemma3n_level2_raw_vllm_loses_scales(gemma3n: Engine) -> None:
    """vLLM 0.26's own level 2 (sleep, wake weights, reload from the same host copy, wake
    kv_cache) on the same engine, after the extension's full cycles: the plain-attribute
    scales read 0.0 at the same address. This documents the bug (vLLM PR #53344). No
    generate afterwards: on the V2 runner that ends in a device-side assert."""
    before = _scales(gemma3n)
    llm = gemma3n.llm
    llm.sleep(2)
    llm.wake_up(["weights"])
    gemma3n.rpc(RELOAD)
    llm.wake_up(["kv_cache"])
    after = _scales(gemma3n)
    print("scales after raw vLLM level 2:", {k: v["value"] for k, v in after.items()})
    assert set(after) == set(before)
    for name, v in before.items():
        assert after[name]["data_ptr"] == v["data_ptr"]
        assert v["value"] != 0.0
        assert after[name]["value"] == 0.0, (name, after[name])
