"""benchmarks/density.py's planning, without engines: the seeded trace, the boot waves that
fit the device, the trace every arm replays cut to the time left, the arms it knows, and
what a KV cache of fixed size makes of an engine's argv (the GPU run's boot:
docs/benchmarks.md)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from benchmarks import common, density
from benchmarks.common import weight_bytes

GiB = 1 << 30


def test_the_trace_is_seeded_and_replayable() -> None:
    a = density.make_trace(["x", "y", "z"], 30.0, 2.0, seed=7)
    assert a == density.make_trace(["x", "y", "z"], 30.0, 2.0, seed=7)
    assert a != density.make_trace(["x", "y", "z"], 30.0, 2.0, seed=8)
    assert all(0 <= r.t < 30.0 for r in a)
    counts = {m: sum(r.model == m for r in a) for m in "xyz"}
    assert counts["x"] > counts["z"]  # Zipf: the first model is the most popular


def test_waves_fit_the_room_and_the_count() -> None:
    plan = [("m0", "big"), ("m1", "small"), ("m2", "small"), ("m3", "big"), ("m4", "small")]
    need = {"big": 40 * GiB, "small": 10 * GiB}
    waves = density.plan_waves(plan, need, room=65 * GiB, most=3)
    assert [[n for n, _ in w] for w in waves] == [["m0", "m1", "m2"], ["m3", "m4"]]
    for w in waves:
        assert sum(need[s] for _, s in w) <= 65 * GiB
    # every engine once, in plan order within a wave
    assert sorted(n for w in waves for n, _ in w) == [n for n, _ in plan]
    # first fit: a small one joins a wave a big one did not fit in
    waves = density.plan_waves(plan, need, room=55 * GiB, most=4)
    assert [n for n, _ in waves[0]] == ["m0", "m1"]
    assert [n for n, _ in waves[1]] == ["m2", "m3"]


def test_an_engine_bigger_than_the_room_boots_alone_and_no_room_is_no_limit() -> None:
    plan = [("m0", "huge"), ("m1", "huge")]
    waves = density.plan_waves(plan, {"huge": 99 * GiB}, room=50 * GiB, most=4)
    assert [[n for n, _ in w] for w in waves] == [["m0"], ["m1"]]
    waves = density.plan_waves(plan, {"huge": 99 * GiB}, room=0, most=4)
    assert [[n for n, _ in w] for w in waves] == [["m0", "m1"]]


def test_the_trace_is_cut_to_what_the_budget_leaves_every_arm() -> None:
    args = density.parse_args(
        [
            "--trace-s",
            "300",
            "--budget-s",
            "470",
            "--reserve-s",
            "30",
            "--arm-overhead-s",
            "30",
            "--budget-gib",
            "124",
        ]
    )
    # 200 s booting: 240 s left for 3 arms, 30 s each besides the trace
    assert density.trace_cut(args, ["static", "l1", "deep"], 200.0) == pytest.approx(50.0)
    assert density.trace_cut(args, ["l1"], 0.0) == 300.0  # the whole trace fits
    assert density.trace_cut(args, ["l1", "deep"], 460.0) == 0.0  # nothing left
    assert density.trace_cut(args, [], 0.0) == 0.0


def test_unknown_arms_are_refused_and_the_vllm_arm_runs_last() -> None:
    with pytest.raises(SystemExit):
        density.parse_args(["--arms", "static,bogus", "--budget-gib", "100"])
    with pytest.raises(SystemExit):  # attached GPU engines: no budget is measured for them
        density.parse_args(["--engine", "gpu"])
    assert density.parse_args(["--engine", "cpu"]).budget_gib is None
    assert density.NOT_AN_ARM == {}
    assert "vllm" in density.ARMS
    assert density.parse_args(["--engine", "cpu"]).arms == "static,vllm,l1,deep"
    # after the vllm arm the engines are asleep by vLLM's allocator: it runs last
    assert density.arm_order(["static", "vllm", "l1", "deep"]) == ["static", "l1", "deep", "vllm"]
    assert density.VLLM_DRIVEN == {"sleep_driver": "vllm", "accept_unverified_wake": True}
    assert density.DEEP_SLEEP == {"deep": "always", "pressure": "pressure"}


def test_a_fixed_kv_cache_replaces_the_utilization_sizing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(common, "write_config", lambda shape, d: d)  # no transformers here
    args = density.parse_args(
        [
            "--kv-gib",
            "llama3-8b=24,llama32-1b=6",
            "--boot-util",
            "0.05",
            "--slack-gib",
            "3",
            "--budget-gib",
            "124",
        ]
    )
    assert density.awake_bytes(args, "llama3-8b") == weight_bytes("llama3-8b") + 27 * GiB
    assert density.awake_bytes(args, "llama32-1b") == weight_bytes("llama32-1b") + 9 * GiB
    argv = density.engine_argv(args, "llama3-8b", "m00", tmp_path)
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(24 * GiB)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.05"
    assert "--enforce-eager" in argv  # --graphs 0: no compile, no capture
    plain = density.engine_argv(
        density.parse_args(["--budget-gib", "124"]), "llama32-1b", "m01", tmp_path
    )
    assert "--kv-cache-memory-bytes" not in plain  # sized by its utilization, as before
    assert plain[plain.index("--gpu-memory-utilization") + 1] == "0.2"


def test_weight_bytes_match_the_shapes_parameter_counts() -> None:
    # Llama 3 8B: 8.03e9 parameters; Llama 3.2 1B: 1.24e9 (tied); 3B: 3.21e9 (tied)
    assert weight_bytes("llama3-8b") == pytest.approx(2 * 8.03e9, rel=0.01)
    assert weight_bytes("llama32-1b") == pytest.approx(2 * 1.236e9, rel=0.01)
    assert weight_bytes("llama32-3b") == pytest.approx(2 * 3.213e9, rel=0.01)


class FakeEngine:
    """An engine process as boot() sees it: up at once, or exited with a log."""

    def __init__(self, name: str, dies: bool) -> None:
        self.name, self.dies, self.stopped = name, dies, False
        self.returncode = 1 if dies else None

    def is_alive(self) -> bool:
        return not self.dies

    def ping(self, timeout_s: float) -> bool:
        return not self.dies

    def log_tail(self, lines: int = 40) -> str:
        return "ValueError: Free memory on device ... less than desired (fake)\n" * 3

    def stop(self, grace_s: float | None = None) -> int | None:
        self.stopped = True
        return self.returncode


def test_an_engine_that_dies_at_boot_is_left_out_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: dict[str, FakeEngine] = {}
    slept: list[list[str]] = []

    def launch(name: str, argv: object, sock: Path, env: object, logs: Path) -> FakeEngine:
        made[name] = FakeEngine(name, dies=name == "m01")
        return made[name]

    monkeypatch.setattr(density, "launch_on_socket", launch)
    monkeypatch.setattr(density, "engine_argv", lambda *a: ["vllm"])
    monkeypatch.setattr(density, "device_query", lambda field: 0)  # no device: no byte limit
    monkeypatch.setattr(density, "sleep_raw", lambda wave, socks: slept.append(sorted(wave)))
    args = density.parse_args(["--engine", "cpu", "--models", "5", "--wave", "2"])
    engines: dict[str, object] = {}
    socks, info = density.boot(args, tmp_path, tmp_path, tmp_path, engines)  # type: ignore[arg-type]
    assert sorted(engines) == ["m00", "m02", "m03", "m04"]
    assert sorted(socks) == sorted(engines)
    assert made["m01"].stopped
    assert "exited 1" in info["failed"]["m01"]
    assert "Free memory" in (tmp_path / "boot-failed-m01.log").read_text()
    assert [w["models"] for w in info["waves"]] == [["m00", "m01"], ["m02", "m03"], ["m04"]]
    assert slept == [["m00"], ["m02", "m03"]]  # each wave asleep before the next, not the last
    made.clear()
    started: dict[str, object] = {}
    with pytest.raises(RuntimeError, match="fewer than"):
        density.boot(
            density.parse_args(["--engine", "cpu", "--models", "2", "--min-models", "2"]),
            tmp_path,
            tmp_path,
            tmp_path,
            started,  # type: ignore[arg-type]
        )
    assert list(started) == ["m00"]  # the one up is the caller's to stop


def test_replot_draws_every_request_of_every_arm(tmp_path: Path) -> None:
    recs = [
        {"arm": "static", "t": 0.5, "model": "m00", "status": 200, "ttft_s": 0.05},
        {"arm": "static", "t": 1.0, "model": "m07", "status": 503, "ttft_s": None},
        {"arm": "deep", "t": 2.0, "model": "m07", "status": 200, "ttft_s": 2.4},
    ]
    src = tmp_path / "density-requests.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = density.main(["--replot", str(src), "--out", str(tmp_path), "--engine", "gpu"])
    assert set(out) == {"png"}  # a plot only: nothing booted
    text = (tmp_path / "density.svg").read_text()
    assert text.count("<circle") == 2  # the served ones
    assert text.count('fill="red">x<') == 1  # the one not served
    assert ">static<" in text
    assert ">deep<" in text


def test_the_sidecar_log_kept_is_its_decisions_whole_and_its_tail(tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    plan = "INFO    hotswap.swap [model=m01 phase=policy] m01: wake plan evict: over budget"
    http = 'INFO    httpx HTTP Request: GET http://m03/is_paused "HTTP/1.1 200 OK"'
    access = 'INFO    uvicorn.access 127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200'
    log.write_text("\n".join([plan] + [http, access] * 300) + "\n")
    kept = density.decisions(log)
    head, tail = kept.split("# the log's last 100 lines")
    assert head.strip() == plan  # the plan kept, however far back; no HTTP line
    assert tail.strip().splitlines() == [http, access] * 50
    assert density.parse_args(["--engine", "cpu"]).warm == 0  # a cold start unless asked
    assert "no log" in density.decisions(tmp_path / "missing.log")


def test_the_share_within_the_slo_is_also_given_after_the_cold_start() -> None:
    rec = [
        {"t": 1.0, "status": 200, "ttft_s": 4.0},  # the cold start's wake: a miss
        {"t": 2.0, "status": 503, "ttft_s": None},
        {"t": density.COLD_S, "status": 200, "ttft_s": 0.1},
        {"t": 9.0, "status": 200, "ttft_s": 2.5},
    ]
    got = density.summarize(rec)
    assert got["within_slo"] == 0.25
    assert got["within_slo_after_cold"] == 0.5
    assert density.summarize(rec[:2])["within_slo_after_cold"] is None


def test_explain_reads_where_an_arms_misses_came_from(tmp_path: Path) -> None:
    reqs = [
        {"arm": "l1", "t": 1.0, "model": "m00", "status": 200, "ttft_s": 3.0},  # cold
        {"arm": "l1", "t": 21.0, "model": "m01", "status": 429, "ttft_s": None},  # burst
        {"arm": "l1", "t": 30.0, "model": "m01", "status": 200, "ttft_s": 2.5},  # between
        {"arm": "l1", "t": 31.0, "model": "m02", "status": 200, "ttft_s": 0.1},  # served
    ]
    (tmp_path / "density-requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    swap, manager = "INFO    hotswap.swap [model=m01 phase=policy]", "INFO    hotswap.manager"
    log = [
        f"{swap} m01: wake plan evict: over budget (1 held + 2 > 2): evicting the least used"
        " m03 (idle 1.0 s, 0.5 recent requests), m04 (idle 2.0 s, 0.1 recent requests)",
        f"{swap} m01: swapped in after 0.700 s (evicted m03, m04 in 0.400 s, wake 0.300 s)",
        "INFO    hotswap.swap m02: wake plan deepen: over budget: taking m05 deep first",
        f"{manager} [model=m05 phase=checkpoint] m05: deepen checkpoint took 0.650 s",
        f"{manager} [model=m02 phase=restore] m02: wake restore took 0.500 s",
        f"{manager} [model=m02 phase=warmup] m02: wake warmup took 0.001 s",
        f"{swap} m01: wake planned again once its peers settle: over budget (...): not"
        " evicting m00 (40.0 recent requests, m01 2.0) while m04, asked less, still wake",
        "ERROR   hotswap.manager [model=m04 phase=wait_room] m04: wake failed in wait_room:"
        " m08, evicted for m04, did not release its weights (state RUNNING)",
    ]
    (tmp_path / "sidecar-l1.log").write_text("\n".join(log) + "\n# the log's last 100 lines\n")
    got = density.explain(tmp_path)["l1"]
    assert (got["requests"], got["missed"]) == (4, 3)
    assert got["missed_by"]["window"] == {"cold": 1, "burst": 1, "between": 1}
    assert got["missed_by"]["code"] == {"200": 2, "429": 1}
    assert got["plans"] == {"evict": 1, "deepen": 1}
    assert (got["planned_again"], got["room_failed"]) == (1, 1)
    assert got["victims"] == {"m03": 1, "m04": 1}
    assert got["swapped_in_s"]["p50"] == 0.7
    assert got["driver_s"]["deepen checkpoint"]["sum"] == 0.65
    assert got["driver_s"]["wake restore"]["n"] == 1
    assert "wake warmup" not in got["driver_s"]  # the driver's copies only
    assert got["within_slo"] == 0.25
    early = density.explain(tmp_path, prefix_s=25.0)["l1"]  # the first 25 s of the trace
    assert (early["requests"], early["missed"], early["within_slo"]) == (2, 2, 0.0)


def test_a_sidecar_whose_port_was_taken_starts_again_on_new_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness picks a port free, then the sidecar binds it: a port another process took
    meanwhile is picked again (a real `hotswap serve`, its first port held by this test)."""
    from benchmarks import fleetbench

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]
        picks = iter([held])
        real = common.free_port
        monkeypatch.setattr(common, "free_port", lambda: next(picks, None) or real())
        side, gw = fleetbench.start_sidecar([], tmp_path / "s.log", timeout_s=60)
        try:
            assert gw is None
            assert side.ping()
            assert f":{held}" not in side.base_url
            assert fleetbench.PORT_TAKEN in (tmp_path / "s.log").read_text().lower()
        finally:
            side.stop(10.0)
