"""The tests' one toolbox; fixtures stay in the conftest files, and what a test imports comes
from here (a conftest or a test module is never imported as a module).

- the sidecar: as a process (`sidecar`), on a thread of this process (`sidecarthread`), in
  memory over fake engines (`fakesidecar`, the gateway's `gatewayworld`), one model's
  manager on a fake clock (`rig`); an app reached in memory or on uvicorn (`asgi`);
- engines: real vLLM servers (`engines`), the fake vLLM (`fakevllm`), tiny seeded models
  (`models`);
- waiting on a record's changes (`wait`), process trees and a benchmark run as a process
  (`procs`), Prometheus samples (`metrics`), httpx's one-call functions without a CA
  bundle loaded per call (`oneshot`).
"""
