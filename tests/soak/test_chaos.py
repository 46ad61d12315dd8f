"""The chaos soak, two minutes of it (``PGLEADERLOCK_SOAK_S``; seed
``PGLEADERLOCK_SOAK_SEED``, else a random one, printed): four replica processes, each
running every feature of the library at once, under random faults (SIGKILL, two
SIGKILLs, SIGTERM, SIGSTOP, a terminated lock session, fast and immediate server
restarts), then every invariant of ``support.chaos_check`` over the record: no safety
violation (a stale fenced row, a unit of work committed under a later term, two
leaders, more holders than slots, a slot applied twice or never, a checkpoint out of
step), and no availability finding (a belief that outlived its lock, a lock granted
and not led, a stuck lifecycle, a blocked event loop, a name led by nobody, a loop
that stopped, a replica that crashed, a leaked session). ``benchmarks/chaos.py`` is the
long run."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest

from support.chaos_check import SAFETY, check
from support.chaos_data import SoakData
from support.chaos_soak import FAULT_DECK, Soak, SoakConfig

pytestmark = [pytest.mark.integration, pytest.mark.soak, pytest.mark.timeout(900)]

SOAK_S = float(os.environ.get("PGLEADERLOCK_SOAK_S", "120"))


def test_every_feature_together_under_random_faults() -> None:
    seed = int(os.environ.get("PGLEADERLOCK_SOAK_SEED", random.randrange(1 << 32)))
    out = Path(tempfile.mkdtemp(prefix="chaos-soak-"))  # kept when the test fails
    print(f"\nchaos soak: seed {seed} (PGLEADERLOCK_SOAK_SEED={seed} runs it again)")
    Soak(SoakConfig(seconds=SOAK_S, seed=seed), out).run()
    report = check(SoakData.load(out))
    print(report.format())
    told = f"seed {seed}, the record in {out} (benchmarks/chaos.py --check {out})"
    if SOAK_S >= 120:
        assert set(report.faults) == set(FAULT_DECK), f"{told}: a kind of fault never came"
    assert set(report.rows) == {"lock", "sem", "name", "sched"}, f"{told}: a feature never wrote"
    assert report.slots["due"] > 0, told
    safety = report.of(*SAFETY)
    assert not safety, f"{told}: safety violations\n{report.format()}"
    assert not report.findings, f"{told}: availability findings\n{report.format()}"
    shutil.rmtree(out)
