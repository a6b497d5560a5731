"""CPU of the gateway's body scan (controller.http.jsonscan) over 4 MiB bodies of the
shapes that cost it the most, for one checkout or several side by side.

    python3 scripts/scanbench.py [CHECKOUT ...]

Each shape is fed to `JsonScan(64, {"model", "stream"})` in the guard's 8 KiB slices, in a
child process per checkout (its code first on the path); printed: the thread CPU of the
whole body and of its longest slice (best of two runs), and the scan's verdict. On a shared
machine the figures spread with its load: interleave checkouts and compare.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHILD = r"""
import sys, time
from controller.http.jsonscan import JsonScan
CAP, SLICE = 4 << 20, 8 << 10
def fill(prefix, unit, suffix):
    return prefix + unit * ((CAP - len(prefix) - len(suffix)) // len(unit)) + suffix
head = b'{"model": "nope", "prompt": ['
def chain(unit, depth=60):
    return fill(head, unit * depth + b"]" * depth + b",", b"[]]}")
shapes = {
    "text": fill(b'{"model": "nope", "prompt": "', b"abcdefgh", b'"}'),
    "token ids": fill(head, b"12345,", b"1]}"),
    "members": fill(b'{"model": "nope", ', b'"a":1,', b'"b":1}'),
    "empty lists": fill(head, b"[],", b"[]]}"),
    "[[] chains": chain(b"[[]"),
    "[1, chains": chain(b"[1,"),
    '["", chains': chain(b'["",'),
    "side-by-side groups": fill(head, b"[[[[[[]]]]]],", b"[]]}"),
    "nested groups": fill(head, b"[" * 14 + b"]" * 14 + b",", b"[]]}"),
    "depth-61 runs": fill(head, b"[" * 61 + b"]" * 61 + b",", b"[]]}"),
}
for name, body in shapes.items():
    best = None
    for _ in range(2):
        scanner = JsonScan(64, frozenset({"model", "stream"}))
        longest, t0 = 0.0, time.thread_time()
        for i in range(0, len(body), SLICE):
            t = time.thread_time()
            scanner.feed(body[i : i + SLICE])
            longest = max(longest, time.thread_time() - t)
        took = time.thread_time() - t0
        best = (took, longest) if best is None or took < best[0] else best
    shape = scanner.result()
    print(f"  {name:20s} {best[0] * 1000:7.1f} ms, longest slice {best[1] * 1000:5.2f} ms"
          f" (depth {shape.depth}, balanced {shape.balanced})", flush=True)
"""


def main(argv: list[str]) -> int:
    checkouts = [Path(a).resolve() for a in argv] or [Path(__file__).resolve().parent.parent]
    for checkout in checkouts:
        print(checkout.name or str(checkout), flush=True)
        subprocess.run([sys.executable, "-c", CHILD], cwd=checkout, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
