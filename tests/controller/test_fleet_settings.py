"""The fleet settings (placement, host budget, idle sleep): resolved and validated at start,
a bad value refused with one line that says which and why."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from controller.cli import settings_errors
from controller.config.settings import Settings


def managed(name: str, *extra: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "command": ["vllm", "serve", "m", *extra], **fields}


def refused(**kw: Any) -> str:
    with pytest.raises(ValidationError) as info:
        Settings(**kw)
    line = settings_errors(info.value)
    assert "\n" not in line
    return line


def test_managed_models_are_placed_on_the_declared_devices() -> None:
    s = Settings(
        swap={"devices": ["0", "1", "2"]},
        models=[
            managed("a"),
            managed("t", "--tensor-parallel-size", "2"),
            managed("b", devices=["2"]),
            {"name": "x", "url": "http://127.0.0.1:9", "device": "1"},
        ],
    )
    placed = {m.name: (m.placement, m.env.get("CUDA_VISIBLE_DEVICES")) for m in s.models}
    assert placed == {
        "a": (("0",), "0"),
        "t": (("0", "1"), "0,1"),
        "b": (("2",), "2"),
        "x": (("1",), None),  # attached: someone else started it; only counted there
    }
    assert s.hot_swap


def test_without_declared_devices_nothing_changes() -> None:
    s = Settings(models=[managed("a", "-tp", "2"), managed("b", device="3")])
    assert [(m.placement, m.env) for m in s.models] == [(("0",), {}), (("3",), {})]


def test_placement_is_stable_when_the_settings_are_validated_again() -> None:
    s = Settings(swap={"devices": ["0", "1"]}, models=[managed("a"), managed("b")])
    again = Settings.model_validate(s.model_dump())
    assert [m.placement for m in again.models] == [("0",), ("1",)]


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        (
            {"swap": {"devices": ["0"]}, "models": [managed("a", devices=["4"])]},
            "model a: device(s) 4 not among swap.devices (0)",
        ),
        (
            {"swap": {"devices": ["0"]}, "models": [managed("a", "-tp", "2")]},
            "model a: needs 2 devices, swap.devices has 1",
        ),
        (
            {"models": [managed("a", "-tp", "2", devices=["0"])]},
            "1 device(s) ['0'] for tensor parallel size 2",
        ),
        (
            {"models": [managed("a", "-tp", "4", tp_size=2)]},
            "tp_size 2 but its command says --tensor-parallel-size 4",
        ),
        (
            {
                "swap": {"devices": ["0", "1"]},
                "models": [managed("a", env={"CUDA_VISIBLE_DEVICES": "1"}, devices=["0"])],
            },
            "disagrees with its placement",
        ),
        ({"swap": {"devices": ["0;rm"]}}, "swap.devices.0"),
        ({"swap": {"host_budget": 1.5}}, "a fraction of the machine's RAM must be in (0, 1]"),
        ({"swap": {"host_budget": -1}}, "swap.host_budget"),
        ({"swap": {"idle_sleep_s": -1}}, "swap.idle_sleep_s"),
        ({"swap": {"idle_sleep_level": 3}}, "swap.idle_sleep_level"),
        ({"models": [managed("a", idle_sleep_level=0)]}, "models.0.idle_sleep_level"),
    ],
)
def test_bad_fleet_settings_are_refused_with_one_line(kw: dict[str, Any], says: str) -> None:
    assert says in refused(**kw)


@pytest.mark.parametrize(
    ("raw", "kind"), [("1073741824", int), ("0.25", float), ("1", int), ("1.0", float)]
)
def test_host_budget_from_the_environment_is_bytes_or_a_fraction(
    monkeypatch: pytest.MonkeyPatch, raw: str, kind: type
) -> None:
    monkeypatch.setenv("HOTSWAP_SWAP__HOST_BUDGET", raw)
    value = Settings().swap.host_budget
    assert type(value) is kind
    assert Settings().hot_swap


def test_idle_sleep_per_model_over_the_default() -> None:
    s = Settings(
        swap={"idle_sleep_s": 60, "idle_sleep_level": 2},
        models=[
            managed("a"),
            managed("b", idle_sleep_s=0),
            managed("c", idle_sleep_s=5, idle_sleep_level=1),
        ],
    )
    assert [s.idle_sleep(m) for m in s.models] == [(60, 2), (None, 2), (5, 1)]
