"""Model coverage: for each architecture people serve, does vLLM's own sleep keep it correct,
and does ours? One matrix, generated here, kept in docs/coverage.md. Its rows (one tiny
config per architecture, and the seeded checkpoint each writes) are worker_ext.devarches's.

    python -m benchmarks.coverage run --out DIR [--rows a,b] [--jobs N] [--budget-s S]
    python -m benchmarks.coverage cell --row R --level L --side raw|ours --models DIR --out F
    python -m benchmarks.coverage render DIR_OR_JSON... [--command-text T] > docs/coverage.md

`run` writes every row's tiny model (config.json with `architectures`; seeded bf16
safetensors where transformers can write a checkpoint vLLM loads: both levels load it, a
row without one and `--l1-weights dummy` take vLLM's dummy weights), then runs
one process per cell (row x level x side), several at once on the one GPU (each engine
gets a fixed KV cache, so no engine's memory profile depends on another's), and writes
DIR/coverage.json and DIR/coverage.md. A cell process that crashes or hangs loses only its
own cell: it rewrites its JSON after every phase, and the runner reads what it got to.

A cell starts one in-process engine (CUDA graphs on unless the row says otherwise; the
GPU test extension, which is HotSwapExtension plus read-only probes), generates greedy
tokens and logprobs twice (a non-deterministic model is reported, not compared), reads
the audit's at-risk list for the level, then runs `cycles` sleep/wake cycles:

- raw: vLLM's own `LLM.sleep(level)` / `LLM.wake_up()`; at level 2 `wake_up(["weights"])`,
  `reload_weights`, `wake_up(["kv_cache"])` (vLLM's documented order);
- ours: the controller's RPC order, from `controller.protocol` (quiesce, prepare, suspend;
  resume weights, [reload], resume kv_cache, restore_and_verify), the prefix cache cleared
  first as `/pause` does;

and after each wake the same greedy generation, compared with the pre-sleep tokens and
logprobs. Outcomes per cell: raw `equal` / `DIFFERENT` (silently: no error, other tokens
or logprobs) / `crashed` (where, how); ours `verified, equal` / `FAILED` (naming what the
verification or the sleep reported) / `VERIFIED BUT DIFFERENT` (a bug: the one outcome the
product exists to prevent) / `not supported` (the engine does not start: why).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from worker_ext.devarches import BY_NAME, ROWS, Row, write_model

ROOT = Path(__file__).resolve().parents[1]
EXTENSION = "tests.gpu.gpu_ext.GpuTestExtension"
PROMPT = [3, 17, 29, 41, 5, 11, 23, 7]
N_TOKENS = 16
HOST_RELOAD = "hotswap_test_reload_host"
# Decode steps replay captured graphs; prefill runs eagerly (no torch.compile: a tiny
# model's start stays a few seconds). Graphs are what a stale storage would break.
GRAPHS: dict[str, Any] = {
    "mode": 0,
    "cudagraph_mode": "FULL_DECODE_ONLY",
    "cudagraph_capture_sizes": [1, 2, 4],
}

# ----------------------------------------------------------------------------- one cell


class Cell:
    """One engine, one level, one side; the JSON result is rewritten after every phase."""

    def __init__(
        self,
        row: Row,
        level: int,
        side: str,
        model: Path,
        out: Path,
        l1_weights: str = "checkpoint",
    ) -> None:
        self.row, self.level, self.side, self.model, self.out = row, level, side, model, out
        written = json.loads((model / "written.json").read_text())
        self.host_reload = level == 2 and not written["checkpoint"]
        # vLLM's dummy weights (uniform within 1e-3) give near-uniform logits: 1-2 distinct
        # greedy tokens, so a level-1 comparison says little; the checkpoint, where there is
        # one, gives real tokens (the default; `--l1-weights dummy` for vLLM's)
        self.dummy = (
            not written["checkpoint"] or self.host_reload or (level == 1 and l1_weights == "dummy")
        )
        self.res: dict[str, Any] = {
            "row": row.name,
            "level": level,
            "side": side,
            "phase": "start",
            "cycles": [],
            "weights": "dummy" if self.dummy else "seeded checkpoint",
            "level2_source": (
                ("host copy: " + written["reason"]) if self.host_reload else "checkpoint"
            )
            if level == 2
            else None,
        }
        self.llm: Any = None

    def save(self, phase: str | None = None) -> None:
        if phase is not None:
            self.res["phase"] = phase
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.res, indent=1, default=str))
        tmp.replace(self.out)

    # -- engine

    def start(self, platform: str) -> None:
        from vllm import LLM

        kw: dict[str, Any] = {
            "model": str(self.model),
            "skip_tokenizer_init": True,
            "worker_extension_cls": EXTENSION,
            "max_model_len": 256,
            "dtype": "bfloat16",
            "seed": 0,
            "max_num_seqs": 4,
            "disable_log_stats": True,
            "kv_cache_memory_bytes": 64 << 20,
        }
        if platform == "cuda":
            kw["enable_sleep_mode"] = True
            kw["gpu_memory_utilization"] = 0.04
            if self.row.graphs:
                kw["compilation_config"] = dict(GRAPHS)
                kw["enforce_eager"] = False
            else:
                kw["enforce_eager"] = True
        else:
            kw["enforce_eager"] = True
        if self.dummy:
            kw["load_format"] = "dummy"
        kw.update(self.row.engine)
        if platform != "cuda":
            kw.pop("attention_backend", None)
        self.res["engine_kwargs"] = kw
        self.llm = LLM(**kw)
        self.res["engine"] = self._describe()

    def _describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            import torch
            import vllm

            out["vllm"] = vllm.__version__
            out["torch"] = torch.__version__
            if torch.cuda.is_available():
                out["device"] = torch.cuda.get_device_name(0)
                out["capability"] = list(torch.cuda.get_device_capability(0))
            cc = self.llm.llm_engine.vllm_config.compilation_config
            out["cudagraph_mode"] = str(getattr(cc, "cudagraph_mode", None))
            out["compile_mode"] = str(getattr(cc, "mode", None))
        except Exception as exc:
            out["describe_error"] = repr(exc)
        try:
            out["kernels"] = self.rpc("hotswap_test_kernels")
        except Exception as exc:
            out["kernels_error"] = repr(exc)
        return out

    def rpc(self, method: str, *args: Any) -> dict[str, Any]:
        res = self.llm.collective_rpc(method, args=args)
        r: dict[str, Any] = res[0]
        return r

    def gen(self) -> tuple[list[int], list[float]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(
            temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True, logprobs=1, detokenize=False
        )
        out = self.llm.generate(TokensPrompt(prompt_token_ids=PROMPT), sp, use_tqdm=False)
        c = out[0].outputs[0]
        lps = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs or [], strict=False)]
        return list(c.token_ids), lps

    # -- the two sides

    def raw_cycle(self) -> dict[str, Any]:
        llm = self.llm
        steps: dict[str, Any] = {}
        t0 = time.monotonic()
        llm.sleep(level=self.level)
        steps["sleep_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        if self.level == 2:
            llm.wake_up(tags=["weights"])
            if self.host_reload:
                r = self.rpc(HOST_RELOAD)
                if not r.get("ok"):
                    raise RuntimeError(f"host reload: {r.get('error')}")
            else:
                llm.collective_rpc("reload_weights")
            llm.wake_up(tags=["kv_cache"])
        else:
            llm.wake_up()
        steps["wake_s"] = time.monotonic() - t0
        return steps

    def ours_sequence(self) -> list[tuple[str, str, tuple[Any, ...]]]:
        """(phase, method, args) in the controller's order for this level: the steps of
        `controller.protocol`, the reload swapped for the host copy's where there is no
        checkpoint."""
        from controller import protocol

        params = protocol.Params(level=self.level, quiesce_timeout_s=30.0)
        steps = (*protocol.sleep_steps(self.level), *protocol.wake_steps(self.level))
        if self.host_reload:
            steps = protocol.with_method(steps, protocol.RELOAD.phase, HOST_RELOAD)
        return [(s.phase, s.method, s.call_args(params)) for s in steps]

    def ours_cycle(self) -> dict[str, Any]:
        self.llm.reset_prefix_cache()  # the controller's /pause?clear_cache=true
        steps: dict[str, Any] = {}
        for phase, method, args in self.ours_sequence():
            r = self.rpc(method, *args)
            keep = {
                k: r.get(k)
                for k in (
                    "ok",
                    "error",
                    "elapsed_s",
                    "at_risk",
                    "protected",
                    "protected_bytes",
                    "fingerprinted",
                    "verified",
                    "mismatched",
                    "restored",
                    "freed_bytes",
                    "restored_bytes",
                    "protection",
                    "protected_ranges",
                    "unnamed_ranges",
                    "unnamed_bytes",
                    "mismatched_ranges",
                    "rebound",
                    "repacked",
                )
                if k in r
            }
            steps[phase] = keep
            if not r.get("ok"):
                steps["failed_at"] = phase
                steps["error"] = str(r.get("error"))
                steps["mismatched"] = list(r.get("mismatched") or [])
                steps["mismatched_ranges"] = list(r.get("mismatched_ranges") or [])
                break
        return steps

    # -- the cell

    def run(self, platform: str, cycles: int) -> int:
        self.save("engine start")
        try:
            self.start(platform)
        except BaseException as exc:
            self.res["outcome"] = "not supported"
            self.res["reason"] = _exc_line(exc)
            self.res["traceback"] = traceback.format_exc()[-4000:]
            self.save("engine start failed")
            return 3
        self.save("engine started")
        try:
            if self.host_reload:
                r = self.rpc("hotswap_test_keep_host_copy")
                if not r.get("ok"):
                    raise RuntimeError(f"host copy: {r.get('error')}")
            base = self.gen()
            again = self.gen()
            self.res["baseline"] = {"tokens": base[0], "logprobs": base[1]}
            self.res["deterministic"] = again == base
            audit = self.rpc("hotswap_audit", self.level, True)
            self.res["audit"] = {
                "ok": audit.get("ok"),
                "error": audit.get("error"),
                "count": audit.get("count"),
                "at_risk": audit.get("at_risk"),
                "at_risk_bytes": audit.get("at_risk_bytes"),
                "protection": audit.get("protection"),
                "unnamed_bytes": audit.get("unnamed_bytes"),
                "unprotected_bytes": audit.get("unprotected_bytes"),
                "unnamed": (audit.get("unnamed") or [])[:16],
                "tensors": [
                    {k: t.get(k) for k in ("name", "bytes", "kind", "pool", "restored", "at_risk")}
                    for t in audit.get("tensors") or []
                    if t.get("at_risk") or t.get("kind") != "parameter"
                ][:200],
            }
        except BaseException as exc:
            self.res["outcome"] = "crashed"
            self.res["reason"] = f"before any sleep: {_exc_line(exc)}"
            self.res["traceback"] = traceback.format_exc()[-4000:]
            self.save("baseline failed")
            return 4
        self.save("baseline")
        for n in range(cycles):
            cyc: dict[str, Any] = {"cycle": n}
            self.res["cycles"].append(cyc)
            self.save(f"cycle {n}: sleep/wake")
            try:
                cyc["steps"] = self.raw_cycle() if self.side == "raw" else self.ours_cycle()
            except BaseException as exc:
                cyc["error"] = _exc_line(exc)
                self.res["traceback"] = traceback.format_exc()[-4000:]
                self.save(f"cycle {n}: sleep/wake raised")
                break
            self.save(f"cycle {n}: generate")
            try:
                toks, lps = self.gen()
            except BaseException as exc:
                cyc["gen_error"] = _exc_line(exc)
                self.res["traceback"] = traceback.format_exc()[-4000:]
                self.save(f"cycle {n}: generate raised")
                break
            cyc.update(compare(base, (toks, lps)))
            cyc["tokens"] = toks
            self.save(f"cycle {n}: done")
            if cyc["steps"].get("failed_at"):
                break
        self.res["outcome"] = judge(self.res)
        self.save("done")
        return 0


def _exc_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:400]


def compare(
    base: tuple[list[int], list[float]], now: tuple[list[int], list[float]]
) -> dict[str, Any]:
    toks_equal = base[0] == now[0]
    first = next((i for i, (a, b) in enumerate(zip(base[0], now[0], strict=False)) if a != b), None)
    diffs = [abs(a - b) for a, b in zip(base[1], now[1], strict=False)]
    return {
        "tokens_equal": toks_equal,
        "first_diff": first,
        "logprobs_equal": len(base[1]) == len(now[1]) and not any(d != 0.0 for d in diffs),
        "logprob_max_diff": max(diffs) if diffs else None,
    }


def judge(res: dict[str, Any]) -> str:
    """The cell's outcome word(s) from its cycles (see the module docstring)."""
    if res.get("outcome") in ("not supported", "crashed"):
        return str(res["outcome"])
    cycles = res.get("cycles") or []
    if not cycles:
        return "crashed"
    for c in cycles:
        steps = c.get("steps") or {}
        if res["side"] == "ours" and steps.get("failed_at"):
            return "FAILED"
        if "error" in c or "gen_error" in c:
            return "crashed"
        if not (c.get("tokens_equal") and c.get("logprobs_equal")):
            return "VERIFIED BUT DIFFERENT" if res["side"] == "ours" else "DIFFERENT"
    return "verified, equal" if res["side"] == "ours" else "equal"


def cell_main(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    row = BY_NAME[args.row]
    cell = Cell(
        row, args.level, args.side, Path(args.models) / row.name, Path(args.out), args.l1_weights
    )
    rc = cell.run(args.platform, args.cycles)
    # The result is on disk; skip the engine's teardown (after a device assert it can hang
    # until the runner's timeout, holding a slot).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# ----------------------------------------------------------------------------- the runner


def _tail(path: Path, n: int = 4000) -> str:
    try:
        data = path.read_bytes()[-n:]
    except OSError:
        return ""
    return data.decode("utf-8", "replace")


def _crash_reason(log: Path, rc: int | None) -> str:
    """What killed a cell process: the last error-looking lines of its log."""
    lines = [ln.strip() for ln in _tail(log, 20000).splitlines() if ln.strip()]
    keys = ("Error", "error", "assert", "Assert", "Traceback", "Aborted", "Killed", "CUDA")
    hits = [ln for ln in lines if any(k in ln for k in keys)]
    what = " | ".join(hits[-3:]) if hits else (lines[-1] if lines else "")
    how = "timed out" if rc is None else f"exit code {rc}"
    return f"{how}: {what}"[:600]


def run_cell_process(
    row: str,
    level: int,
    side: str,
    out: Path,
    platform: str,
    cycles: int,
    timeout_s: float,
    models: Path | None = None,
    l1_weights: str = "checkpoint",
) -> dict[str, Any]:
    cells = out / "cells"
    name = f"{row}-L{level}-{side}"
    result, log = cells / f"{name}.json", cells / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.coverage",
        "cell",
        "--row",
        row,
        "--level",
        str(level),
        "--side",
        side,
        "--models",
        str(models or out / "models"),
        "--out",
        str(result),
        "--platform",
        platform,
        "--cycles",
        str(cycles),
        "--l1-weights",
        l1_weights,
    ]
    t0 = time.monotonic()
    rc: int | None
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
    try:
        res: dict[str, Any] = json.loads(result.read_text())
    except (OSError, ValueError):
        res = {"row": row, "level": level, "side": side, "phase": "process start", "cycles": []}
    res["wall_s"] = round(time.monotonic() - t0, 1)
    res["rc"] = rc
    if "outcome" not in res or (
        res.get("phase") != "done"
        and res["outcome"]
        not in (
            "not supported",
            "crashed",
        )
    ):
        # the process died (device assert, abort, hang) in the phase it last wrote
        res["outcome"] = "crashed"
        res["reason"] = f"in '{res.get('phase')}': {_crash_reason(log, rc)}"
    result.write_text(json.dumps(res, indent=1, default=str))
    return res


def prepare_models(rows: Sequence[Row], models: Path) -> dict[str, Any]:
    written: dict[str, Any] = {}
    for row in rows:
        path = models / row.name
        try:
            w = write_model(row, path)
        except Exception as exc:
            w = {"checkpoint": False, "reason": f"config not written: {_exc_line(exc)}"}
        written[row.name] = w
        path.mkdir(parents=True, exist_ok=True)
        (path / "written.json").write_text(json.dumps(w))
        print(f"[coverage] model {row.name}: {w}", flush=True)
    return written


def run_main(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    out = Path(args.out).resolve()
    (out / "cells").mkdir(parents=True, exist_ok=True)
    rows = [BY_NAME[n] for n in args.rows.split(",")] if args.rows else list(ROWS)
    if args.platform == "cpu":
        rows = [r for r in rows if r.cpu or args.rows]
    models = Path(args.models).resolve() if args.models else out / "models"
    written = prepare_models(rows, models)
    sides = args.sides.split(",")
    levels = [int(x) for x in args.levels.split(",")]
    cells = [(r.name, lv, s) for r in rows for lv in levels for s in sides]
    deadline = t_start + args.budget_s
    done: dict[tuple[str, int, str], dict[str, Any]] = {}
    lock = threading.Lock()
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")

    def write() -> dict[str, Any]:
        """coverage.json with every cell so far (rewritten after each: a killed run keeps
        what it measured); cells not finished yet read "not run"."""
        results = [
            done.get(c)
            or {"row": c[0], "level": c[1], "side": c[2], "outcome": "not run", "cycles": []}
            for c in cells
        ]
        doc = {
            "date": started,
            "command": "python -m benchmarks.coverage " + " ".join(sys.argv[1:]),
            "platform": args.platform,
            "models": written,
            "rows": [dataclasses.asdict(r) for r in rows],
            "cells": results,
            "wall_s": round(time.monotonic() - t_start, 1),
        }
        tmp = out / "coverage.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        tmp.replace(out / "coverage.json")
        return doc

    def one(c: tuple[str, int, str]) -> None:
        left = deadline - time.monotonic()
        if left < min(args.cell_timeout_s, 60.0):
            res: dict[str, Any] = {
                "row": c[0],
                "level": c[1],
                "side": c[2],
                "outcome": "not run",
                "reason": "out of time in this device call",
                "cycles": [],
            }
        else:
            res = run_cell_process(
                *c,
                out,
                args.platform,
                args.cycles,
                min(args.cell_timeout_s, left - 5),
                models,
                args.l1_weights,
            )
        print(
            f"[coverage] {c[0]} L{c[1]} {c[2]}: {res['outcome']} "
            f"{str(res.get('reason', ''))[:200]} ({res.get('wall_s')} s)",
            flush=True,
        )
        with lock:
            done[c] = res
            write()

    write()
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, cells))
    doc = write()
    (out / "coverage.md").write_text(render([doc], args.command_text))
    print(f"[coverage] {len(cells)} cells in {doc['wall_s']} s; {out / 'coverage.json'}")
    return 0


# ----------------------------------------------------------------------------- the table


def _cell_text(c: dict[str, Any] | None) -> str:
    if c is None:
        return "not run"
    outcome = str(c.get("outcome"))
    cycles = c.get("cycles") or []
    if outcome in ("equal", "verified, equal"):
        return f"**{outcome}** ({len(cycles)} cycles)"
    if outcome == "DIFFERENT":
        bad: dict[str, Any] = next(
            (x for x in cycles if not (x.get("tokens_equal") and x.get("logprobs_equal"))), {}
        )
        what = (
            f"tokens differ from token {bad.get('first_diff')}"
            if not bad.get("tokens_equal")
            else f"tokens equal, logprobs differ by up to {bad.get('logprob_max_diff'):.3g}"
        )
        return f"**silently different** (cycle {bad.get('cycle')}: {what})"
    if outcome == "FAILED":
        for x in cycles:
            steps = x.get("steps") or {}
            if steps.get("failed_at"):
                names = [str(n) for n in steps.get("mismatched") or []]
                names += [str(r)[:160] for r in steps.get("mismatched_ranges") or []]
                if names:
                    shown = ", ".join(f"`{n}`" for n in names[:6])
                    more = f" and {len(names) - 6} more" if len(names) > 6 else ""
                    what = f"names {shown}{more}"
                else:
                    what = str(steps.get("error"))[:300]
                return f"**FAILED** at {steps['failed_at']}: {what}"
        return "**FAILED**"
    if outcome == "VERIFIED BUT DIFFERENT":
        return "**VERIFIED BUT DIFFERENT (bug)**"
    reason = str(c.get("reason") or "")
    for x in cycles:
        for k in ("error", "gen_error"):
            if k in x:
                reason = f"cycle {x.get('cycle')} {'wake' if k == 'error' else 'generate'}: {x[k]}"
    return f"{outcome}: {reason[:300]}".replace("|", "/")


def _engine_text(cells: list[dict[str, Any]]) -> str:
    for c in cells:
        eng = c.get("engine") or {}
        k = eng.get("kernels") or {}
        if not eng:
            continue
        parts = [f"graphs {eng.get('cudagraph_mode')}"]
        if k.get("attention"):
            parts.append("attn " + "/".join(k["attention"]))
        if k.get("moe"):
            parts.append("MoE " + "/".join(k["moe"]))
        if k.get("linear"):
            parts.append("linear " + "/".join(k["linear"]))
        return "; ".join(parts).replace("|", "/")
    return ""


def _at_risk(cells: list[dict[str, Any]], level: int) -> str:
    """The audit's at-risk count and its names with layer and group numbers folded."""
    for c in cells:
        if c.get("level") == level and (c.get("audit") or {}).get("at_risk") is not None:
            names = c["audit"]["at_risk"]
            if not names:
                return "none"
            short = sorted({re.sub(r"\.\d+(?=\.|$)", ".N", str(n)) for n in names})
            more = f" and {len(short) - 5} more" if len(short) > 5 else ""
            return f"{len(names)}: " + ", ".join(f"`{n}`" for n in short[:5]) + more
    return "?"


def _summary(cells: dict[tuple[str, int, str], dict[str, Any]]) -> list[str]:
    """One line per side: how many cells ended how; and the FP8 MoE path vLLM picked."""
    lines = []
    for side, label in (("raw", "raw vLLM"), ("ours", "ours")):
        counts: dict[str, list[str]] = {}
        for (row, level, s), c in sorted(cells.items()):
            if s == side:
                counts.setdefault(str(c.get("outcome")), []).append(f"{row} L{level}")
        parts = [
            f"{len(v)} {k}" + (f" ({', '.join(v)})" if len(v) <= 3 else "")
            for k, v in sorted(counts.items(), key=lambda kv: -len(kv[1]))
        ]
        lines.append(f"- {label}: {sum(len(v) for v in counts.values())} cells: {'; '.join(parts)}")
    for (row, _level, _side), c in sorted(cells.items()):
        detail = ((c.get("engine") or {}).get("kernels") or {}).get("detail") or {}
        if detail.get("fp8_backend"):
            moe = "/".join(((c.get("engine") or {}).get("kernels") or {}).get("moe") or [])
            lines.append(
                f"- FP8 MoE path vLLM {((c.get('engine') or {}).get('vllm'))} picked on this "
                f"device ({row}): `{moe}`, backend `{detail['fp8_backend']}`, experts "
                f"`{detail.get('experts_cls')}`"
            )
            break
    return lines


def _weights_lines(cells: dict[tuple[str, int, str], dict[str, Any]]) -> list[str]:
    """Which weights the cells of each level had, and which rows had which."""
    lines = []
    for lv in (1, 2):
        by: dict[str, set[str]] = {}
        for (row, level, _side), c in cells.items():
            if level == lv and c.get("weights"):
                by.setdefault(str(c["weights"]), set()).add(row)
        parts = [f"{w} ({', '.join(sorted(rows))})" for w, rows in sorted(by.items())]
        lines.append(f"- level {lv} weights: " + "; ".join(parts))
    return lines


def _prepare_of(c: dict[str, Any] | None) -> dict[str, Any]:
    for x in (c or {}).get("cycles") or []:
        prep = (x.get("steps") or {}).get("prepare")
        if isinstance(prep, dict) and prep.get("ok"):
            return prep
    return {}


def render(
    docs: Sequence[dict[str, Any]], command: str | None = None, code: str | None = None
) -> str:
    """docs/coverage.md from one or more runs' coverage.json (later runs win per cell)."""
    cells: dict[tuple[str, int, str], dict[str, Any]] = {}
    rows: dict[str, dict[str, Any]] = {}
    models: dict[str, Any] = {}
    for d in docs:
        for r in d["rows"]:
            rows[r["name"]] = r
        models.update(d.get("models") or {})
        for c in d["cells"]:
            if c.get("outcome") == "not run" and (c["row"], c["level"], c["side"]) in cells:
                continue
            cells[(c["row"], c["level"], c["side"])] = c
    eng: dict[str, Any] = next(
        (c["engine"] for c in cells.values() if (c.get("engine") or {}).get("vllm")), {}
    )
    lines = [
        "# Model coverage: vLLM's own sleep and ours, per architecture",
        "",
        "Generated by `python -m benchmarks.coverage render` from the runs' `coverage.json`;",
        "edit the runner (`benchmarks/coverage.py`), not this file.",
        "",
        f"- date: {', '.join(sorted({d['date'] for d in docs}))}",
        f"- device: {eng.get('device', '?')} (sm {'.'.join(map(str, eng.get('capability', [])))}), "
        f"vLLM {eng.get('vllm', '?')}, torch {eng.get('torch', '?')}",
        f"- command: `{command or docs[-1].get('command')}`",
        *([f"- code: {code}"] if code else []),
        "- each cell is its own process and engine: tiny config with `architectures` set, "
        "CUDA graphs on (decode replayed from captured graphs), 16 greedy tokens and their "
        "logprobs compared with the pre-sleep ones after every wake",
        *_weights_lines(cells),
        "- raw: `LLM.sleep(level)` / `wake_up()` (level 2: wake weights, `reload_weights`, "
        "wake kv_cache); ours: quiesce, prepare, suspend, resume weights, [reload], resume "
        "kv_cache, restore_and_verify (the controller's order)",
        "",
        *_summary(cells),
        "",
        "| model | raw vLLM L1 | ours L1 | raw vLLM L2 | ours L2 | at risk L1 | at risk L2 "
        "| engine |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        mine = [c for k, c in cells.items() if k[0] == name]
        cols = [_cell_text(cells.get((name, lv, s))) for lv in (1, 2) for s in ("raw", "ours")]
        lines.append(
            f"| {r['what']} | {' | '.join(cols)} | {_at_risk(mine, 1)} | {_at_risk(mine, 2)} "
            f"| {_engine_text(mine)} |"
        )
    lines += ["", "## Notes per row", ""]
    for name, r in rows.items():
        w = models.get(name) or {}
        bits = [f"`{r['arch']}`", f"engine {json.dumps(r['engine'])}" if r["engine"] else ""]
        if not w.get("checkpoint", True):
            bits.append(f"level 2 from a host copy ({w.get('reason')})")
        elif r.get("note"):
            bits.append(str(r["note"]))
        kern = next(
            (
                (c.get("engine") or {}).get("kernels")
                for k, c in cells.items()
                if k[0] == name and (c.get("engine") or {}).get("kernels")
            ),
            None,
        )
        for lv in (1, 2):
            prep = _prepare_of(cells.get((name, lv, "ours")))
            if prep:
                ranges = prep.get("protected_ranges")
                bits.append(
                    f"ours L{lv}: protection {prep.get('protection', 'objects')}, "
                    f"{prep.get('protected')} protected ({prep.get('protected_bytes')} B"
                    f"{f', {ranges} ranges' if ranges else ''}), "
                    f"{prep.get('fingerprinted')} fingerprinted"
                )
        if kern and kern.get("detail"):
            bits.append(f"kernels: {json.dumps(kern['detail'])[:400]}")
        lines.append(f"- **{r['what']}**: " + "; ".join(b for b in bits if b))
    return "\n".join(lines) + "\n"


def render_main(args: argparse.Namespace) -> int:
    docs = []
    for p in args.inputs:
        path = Path(p)
        docs.append(json.loads((path / "coverage.json" if path.is_dir() else path).read_text()))
    sys.stdout.write(render(docs, args.command_text, args.code))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.coverage", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="write the models, run every cell, write the matrix")
    run.add_argument("--out", required=True)
    run.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    run.add_argument("--models", default="", help="where the models go (default: OUT/models)")
    run.add_argument("--levels", default="1,2")
    run.add_argument("--sides", default="raw,ours")
    run.add_argument("--jobs", type=int, default=4, help="cell processes at once")
    run.add_argument("--budget-s", type=float, default=540.0)
    run.add_argument("--cell-timeout-s", type=float, default=240.0)
    run.add_argument("--cycles", type=int, default=2)
    run.add_argument("--platform", choices=("cuda", "cpu"), default="cuda")
    run.add_argument("--l1-weights", choices=("dummy", "checkpoint"), default="checkpoint")
    run.add_argument("--command-text", default=None, help="the command line shown in the doc")
    cell = sub.add_parser("cell", help="one row, level and side (its own process)")
    cell.add_argument("--row", required=True, choices=sorted(BY_NAME))
    cell.add_argument("--level", type=int, choices=(1, 2), required=True)
    cell.add_argument("--side", choices=("raw", "ours"), required=True)
    cell.add_argument("--models", required=True)
    cell.add_argument("--out", required=True)
    cell.add_argument("--platform", choices=("cuda", "cpu"), default="cuda")
    cell.add_argument("--cycles", type=int, default=2)
    cell.add_argument("--l1-weights", choices=("dummy", "checkpoint"), default="checkpoint")
    ren = sub.add_parser("render", help="docs/coverage.md from coverage.json files")
    ren.add_argument("inputs", nargs="+")
    ren.add_argument("--command-text", default=None)
    ren.add_argument("--code", default=None, help="which code the runs ran (a line)")
    args = ap.parse_args(argv)
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "run": run_main,
        "cell": cell_main,
        "render": render_main,
    }
    return handlers[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
