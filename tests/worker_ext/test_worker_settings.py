"""Worker settings (worker_ext.settings): parsed once from the environment, frozen; the
tuning set in-process only."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from worker_ext import settings
from worker_ext.settings import VARIABLES, Tuning, WorkerSettings


@pytest.fixture(autouse=True)
def _default_tuning() -> Iterator[None]:
    yield
    settings.tune(Tuning())


def test_defaults() -> None:
    s = WorkerSettings.from_env({})
    assert s == WorkerSettings()
    assert (s.keep_host_backup, s.pin_early, s.verify_kernel) == (True, True, "auto")
    assert (s.host_codec, s.warm_prepare, s.disk_dir) == ("exp", True, "")
    assert s.demotable is False  # it costs every level-1 sleep: on under a host budget only
    assert s.graph_pool == "release"  # graphs captured into a CuMem pool the sleep releases
    assert s.tuning == Tuning()
    assert (s.tuning.codec_piece_mib, s.tuning.codec_slots, s.tuning.disk_threads) == (64, 2, 16)
    assert (s.tuning.protect, s.tuning.codec_plan_reuse) == ("ranges", True)


def test_every_variable_is_read() -> None:
    s = WorkerSettings.from_env(
        {
            "HOTSWAP_KEEP_HOST_BACKUP": "0",
            "HOTSWAP_HOST_CODEC": "None",
            "HOTSWAP_VERIFY_KERNEL": "0",
            "HOTSWAP_WARM_PREPARE": "0",
            "HOTSWAP_DEMOTABLE": "on",
            "HOTSWAP_DISK_DIR": " /var/tier ",
            "HOTSWAP_DISK_BUDGET_GB": "1.5",
            "HOTSWAP_GRAPH_POOL": " Poison",
        }
    )
    want = WorkerSettings(False, "none", "off", False, True, "/var/tier", 1_500_000_000, "poison")
    assert s == want


def test_one_variable_per_field_and_at_most_eight() -> None:
    fields = [f.name for f in dataclasses.fields(WorkerSettings) if f.name != "tuning"]
    assert sorted(v.field for v in VARIABLES) == sorted(fields)
    assert len({v.name for v in VARIABLES}) == len(VARIABLES) <= 8
    assert all(v.name.startswith("HOTSWAP_") and "__" not in v.name for v in VARIABLES)


def test_bad_words_fall_back_to_the_defaults() -> None:
    s = WorkerSettings.from_env(
        {
            "HOTSWAP_VERIFY_KERNEL": "maybe",
            "HOTSWAP_HOST_CODEC": "zstd",
            "HOTSWAP_DISK_BUDGET_GB": "lots",
            "HOTSWAP_GRAPH_POOL": "off",
        }
    )
    assert s == WorkerSettings()
    assert WorkerSettings.from_env({"HOTSWAP_DISK_BUDGET_GB": "-3"}).disk_budget_bytes == 0


def test_only_the_listed_variables_are_read() -> None:
    """from_env asks the environment for the listed variables and nothing else (the
    concluded experiments' switches are gone, the tuning is never read from it)."""
    asked: list[str] = []

    class Spy(dict[str, str]):
        def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
            asked.append(key)
            return super().get(key, default)

    WorkerSettings.from_env(Spy())
    assert sorted(asked) == sorted(settings.names())


def test_tuning_is_set_in_process() -> None:
    settings.tune(Tuning(pin_early=False, protect="objects", codec_slots=4))
    s = WorkerSettings.from_env({})
    assert (s.pin_early, s.tuning.protect, s.tuning.codec_slots) == (False, "objects", 4)
    settings.tune(Tuning())
    assert WorkerSettings.from_env({}).tuning == Tuning()


@pytest.mark.parametrize(
    "bad",
    [
        {"pin_threads": 0},
        {"protect": "everything"},
        {"codec_piece_mib": 1},
        {"codec_slots": 65},
        {"disk_threads": 0},
    ],
)
def test_tuning_out_of_range_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="out of range"):
        Tuning(**bad)  # type: ignore[arg-type]


def test_not_keeping_the_buffer_pins_it_lazily() -> None:
    assert WorkerSettings.from_env({"HOTSWAP_KEEP_HOST_BACKUP": "no"}).pin_early is False
    assert WorkerSettings(keep_host_backup=False, tuning=Tuning(pin_early=True)).pin_early


def test_frozen_and_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_HOST_CODEC", "none")
    s = WorkerSettings.from_env()
    monkeypatch.setenv("HOTSWAP_HOST_CODEC", "exp")
    assert s.host_codec == "none"  # a later change of the environment does not reach it
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.host_codec = "exp"  # type: ignore[misc]


def test_off_turns_every_flag_off() -> None:
    """ "off" means off for each on/off variable, as "0", "false" and "no" do."""
    s = WorkerSettings.from_env({"HOTSWAP_WARM_PREPARE": "off", "HOTSWAP_KEEP_HOST_BACKUP": "off"})
    assert (s.warm_prepare, s.keep_host_backup) == (False, False)
