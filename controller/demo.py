"""The embedded default behind `hotswap serve --demo`: two tiny seeded models on two real
CPU vLLM servers (`demo_engines`, attached mode), or their argv for managed mode
(`demo_models`). The models are written by a subprocess, so this process never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from controller.config.modelsettings import ModelSettings
from controller.engines.enginespec import EngineSpec, managed_argv
from controller.engines.launcher import EngineProcess
from controller.engines.sockets import private_dir, socket_path
from controller.errors import EngineStartError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoModel:
    name: str
    arch: str
    seed: int


# One architecture for both: the first engine per architecture pays for model inspection.
DEMO_MODELS = (DemoModel("tiny-a", "llama", 0), DemoModel("tiny-b", "llama", 1))


async def _run(argv: Sequence[str], timeout_s: float) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise EngineStartError(f"{' '.join(argv)} took more than {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        tail = "\n".join(out.decode(errors="replace").splitlines()[-20:])
        raise EngineStartError(f"{' '.join(argv)} failed ({proc.returncode}):\n{tail}")


async def write_demo_models(models_dir: Path, models: Sequence[DemoModel] = DEMO_MODELS) -> None:
    """Write each tiny model (seeded weights and an offline tokenizer) unless already there.

    A subprocess of the same interpreter does it, so this process never imports torch.
    """
    todo = [m for m in models if not (models_dir / m.name / "config.json").is_file()]
    await asyncio.gather(
        *(
            _run(
                [
                    *(sys.executable, "-m", "worker_ext.devmodels", str(models_dir)),
                    *("--arch", m.arch, "--seed", str(m.seed), "--tokenizer", "--name", m.name),
                ],
                timeout_s=300.0,
            )
            for m in todo
        )
    )


@contextlib.asynccontextmanager
async def demo_engines(
    workdir: Path | None = None,
    *,
    uni: bool = True,
    ready_timeout_s: float = 300.0,
    argv: Callable[[list[str]], Sequence[str]] | None = None,
) -> AsyncIterator[list[ModelSettings]]:
    """Two tiny models on two real CPU vLLM servers, started one after the other.

    `argv`, if given, rewrites each engine's argv (the tests fork the EngineCore through it).

    Yields their ModelSettings (attached mode: the sidecar drives, this owns the processes);
    stops both on exit. Models and logs go to `workdir` (a temporary folder when None).
    """
    own = workdir is None
    root = Path(tempfile.mkdtemp(prefix="hotswap-demo-")) if workdir is None else workdir
    root.mkdir(parents=True, exist_ok=True)
    sockets = private_dir()
    engines: list[EngineProcess] = []
    try:
        await write_demo_models(root / "models")
        settings: list[ModelSettings] = []
        for m in DEMO_MODELS:
            uds = socket_path(sockets, m.name)
            spec = EngineSpec(
                model=root / "models" / m.name, uds=uds, served_model_name=m.name, uni=uni
            )
            if argv is not None:
                spec = replace(spec, command=tuple(argv(spec.argv())))
            engine = EngineProcess(spec, root / "logs" / f"{m.name}.log")
            engines.append(engine)
            engine.start()  # on this thread: the keeper dies with it
            waited = await asyncio.to_thread(engine.wait_ready, ready_timeout_s)
            log.info("demo engine %s ready at %s after %.1f s", m.name, uds, waited)
            settings.append(
                ModelSettings.model_validate(
                    {"name": m.name, "uds": str(uds), "served_model_name": m.name}
                )
            )
        yield settings
    finally:
        for engine in reversed(engines):
            await asyncio.to_thread(engine.stop)
        shutil.rmtree(sockets, ignore_errors=True)
        if own:
            shutil.rmtree(root, ignore_errors=True)


async def demo_models(workdir: Path, *, uni: bool = True) -> list[ModelSettings]:
    """The embedded default under managed mode: the tiny models (written to `workdir` unless
    there), each with its engine's argv and env; the sidecar starts them on its own sockets."""
    await write_demo_models(workdir / "models")
    models = []
    for m in DEMO_MODELS:
        spec = EngineSpec(
            model=workdir / "models" / m.name, uds=Path(), served_model_name=m.name, uni=uni
        )
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if uni else {}
        models.append(
            ModelSettings.model_validate(
                {
                    "name": m.name,
                    "command": managed_argv(spec),
                    "env": env,
                    "served_model_name": m.name,
                }
            )
        )
    return models
