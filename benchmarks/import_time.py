"""Import time: ``import pgleaderlock`` next to ``import asyncio``, in fresh interpreters.

Each module is imported in ``--runs`` fresh interpreters (this one's executable, so the
same environment), alternating between the modules so that a noisy neighbour weighs on
both alike. Two figures per module, medians:

- **import**: the ``import`` statement alone, timed inside the child with
  ``time.perf_counter`` (what a program pays for the import, start-up excluded);
- **process**: the whole child, start to exit, timed from here (start-up included, the
  way a short CLI run feels it).

The ratio pgleaderlock / asyncio is printed for both; issue 31's target is at most 2.
``--module`` adds modules (e.g. ``pgleaderlock.core``) to the comparison.

    .venv/bin/python benchmarks/import_time.py
    .venv/bin/python benchmarks/import_time.py --runs 21 --module pgleaderlock.schedule
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CHILD = "import time\nt = time.perf_counter()\nimport {module}\nprint(time.perf_counter() - t)\n"


def once(module: str) -> tuple[float, float]:
    """One fresh interpreter: (import seconds, process seconds)."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(module=module)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(out), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh interpreters per module")
    parser.add_argument("--module", action="append", default=[], help="another module")
    args = parser.parse_args()
    modules = ["asyncio", "pgleaderlock", *args.module]
    for module in modules:
        once(module)  # warm the file system cache and the bytecode
    samples: dict[str, list[tuple[float, float]]] = {m: [] for m in modules}
    for _ in range(args.runs):
        for module in modules:
            samples[module].append(once(module))
    medians = {
        m: (statistics.median(s[0] for s in runs), statistics.median(s[1] for s in runs))
        for m, runs in samples.items()
    }
    print(f"median of {args.runs} fresh interpreters, {sys.executable} ({sys.version.split()[0]})")
    print(f"{'module':<28}{'import ms':>12}{'process ms':>12}")
    for module, (imp, proc) in medians.items():
        print(f"{module:<28}{imp * 1e3:>12.1f}{proc * 1e3:>12.1f}")
    base_imp, base_proc = medians["asyncio"]
    for module in modules[1:]:
        imp, proc = medians[module]
        print(
            f"ratio {module} / asyncio: import {imp / base_imp:.2f}x, "
            f"process {proc / base_proc:.2f}x"
        )


if __name__ == "__main__":
    main()
