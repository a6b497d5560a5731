"""Worker settings (worker_ext.settings): parsed once from the environment, frozen."""

from __future__ import annotations

import dataclasses

import pytest

from worker_ext.settings import WorkerSettings


def test_defaults() -> None:
    s = WorkerSettings.from_env({})
    assert s == WorkerSettings()
    assert (s.keep_host_backup, s.pin_mode, s.kv_map_mode) == (True, "early", "wait")
    assert (s.map_impl, s.map_handles, s.pin_threads) == ("driver", "vllm", 4)
    assert (s.resume_sync, s.verify_kernel, s.protect) == (False, "auto", "ranges")
    assert (s.host_codec, s.codec_piece_mib, s.codec_slots) == ("exp", 64, 2)
    assert s.demotable is False  # it costs every level-1 sleep: on under a host budget only
    # the tier's warm read measured fastest at 16 threads of 16 MiB preads (H200, 18:03 UTC)
    assert WorkerSettings.from_env({"HOTSWAP_DISK_THREADS": "x"}).disk_threads == 16
    assert s.disk_threads == 16
    assert s.codec_plan_reuse is True


def test_every_variable_is_read() -> None:
    s = WorkerSettings.from_env(
        {
            "HOTSWAP_KEEP_HOST_BACKUP": "0",
            "HOTSWAP_PIN_HOST_BACKUP": "early",
            "HOTSWAP_RESUME_KV": " Overlap ",
            "HOTSWAP_MAP_IMPL": "vllm",
            "HOTSWAP_MAP_HANDLES": "none",
            "HOTSWAP_PIN_THREADS": "9",
            "HOTSWAP_RESUME_SYNC": "yes",
            "HOTSWAP_VERIFY_KERNEL": "0",
            "HOTSWAP_PROTECT": "objects",
            "HOTSWAP_HOST_CODEC": "None",
            "HOTSWAP_CODEC_PIECE_MIB": "16",
            "HOTSWAP_CODEC_SLOTS": "5",
            "HOTSWAP_CODEC_COPY_STREAMS": "2",
            "HOTSWAP_CODEC_MAP": "First",
            "HOTSWAP_DISK_DIR": " /var/tier ",
            "HOTSWAP_DISK_BUDGET_GB": "1.5",
            "HOTSWAP_DISK_THREADS": "3",
            "HOTSWAP_WARM_PREPARE": "0",
            "HOTSWAP_DEMOTABLE": "on",
            "HOTSWAP_CODEC_PLAN_REUSE": "Off",
        }
    )
    assert s == WorkerSettings(
        False,
        "early",
        "overlap",
        "vllm",
        "none",
        9,
        True,
        "off",
        "objects",
        "none",
        16,
        5,
        2,
        "first",
        "/var/tier",
        1_500_000_000,
        3,
        False,
        True,
        False,
    )


def test_bad_words_fall_back_to_the_defaults() -> None:
    s = WorkerSettings.from_env(
        {
            "HOTSWAP_PIN_HOST_BACKUP": "sometimes",
            "HOTSWAP_RESUME_KV": "x",
            "HOTSWAP_MAP_IMPL": "y",
            "HOTSWAP_MAP_HANDLES": "z",
            "HOTSWAP_PIN_THREADS": "many",
            "HOTSWAP_VERIFY_KERNEL": "maybe",
            "HOTSWAP_PROTECT": "everything",
            "HOTSWAP_HOST_CODEC": "zstd",
            "HOTSWAP_CODEC_PIECE_MIB": "big",
            "HOTSWAP_CODEC_SLOTS": "several",
            "HOTSWAP_CODEC_COPY_STREAMS": "both",
            "HOTSWAP_CODEC_MAP": "later",
            "HOTSWAP_DISK_BUDGET_GB": "lots",
            "HOTSWAP_DISK_THREADS": "x",
        }
    )
    assert s == WorkerSettings()
    assert WorkerSettings.from_env({"HOTSWAP_CODEC_PIECE_MIB": "0"}).codec_piece_mib == 2
    assert WorkerSettings.from_env({"HOTSWAP_CODEC_SLOTS": "1"}).codec_slots == 2
    assert WorkerSettings.from_env({"HOTSWAP_CODEC_SLOTS": "500"}).codec_slots == 64
    # two copy streams need two slots in flight and two being decoded
    two = WorkerSettings.from_env({"HOTSWAP_CODEC_COPY_STREAMS": "2"})
    assert (two.codec_copy_streams, two.codec_slots) == (2, 4)
    assert WorkerSettings.from_env({"HOTSWAP_CODEC_COPY_STREAMS": "7"}).codec_copy_streams == 2
    assert WorkerSettings.from_env({"HOTSWAP_PIN_THREADS": "-3"}).pin_threads == 1
    # not keeping the buffer makes lazy pinning the default, as before
    assert WorkerSettings.from_env({"HOTSWAP_KEEP_HOST_BACKUP": "no"}).pin_mode == "lazy"


def test_frozen_and_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_PROTECT", "objects")
    s = WorkerSettings.from_env()
    monkeypatch.setenv("HOTSWAP_PROTECT", "ranges")
    assert s.protect == "objects"  # a later change of the environment does not reach it
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.protect = "ranges"  # type: ignore[misc]


def test_off_turns_every_flag_off() -> None:
    """ "off" means off for each on/off variable, as "0", "false" and "no" do."""
    s = WorkerSettings.from_env({"HOTSWAP_WARM_PREPARE": "off", "HOTSWAP_KEEP_HOST_BACKUP": "off"})
    assert (s.warm_prepare, s.keep_host_backup) == (False, False)
