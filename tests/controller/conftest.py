"""Unit tests of the controller: no vLLM, no network beyond loopback. Engines are played by
httpx.MockTransport worlds (fakevllm.FakeVllm, test_manager's World); clocks are faked
where durations are asserted."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    """`@pytest.mark.anyio` tests run on asyncio only (the sidecar's loop)."""
    return "asyncio"
