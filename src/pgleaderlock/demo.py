"""Live demo: candidate processes elect a leader, the leader is killed, a follower takes over.

Run it with one command (without a DSN it starts a throwaway PostgreSQL):

```bash
python -m pgleaderlock.demo
python -m pgleaderlock.demo --dsn postgresql://... --kill terminate --rounds 3
```

Each candidate is a separate OS process (``python -m pgleaderlock.testing.candidate``)
running one [`LeaderLock`][pgleaderlock.LeaderLock]. It reports its callbacks to the parent as
JSON lines on stdout; the parent kills leaders, measures failovers and checks that no two
candidates believed themselves leader at the same time.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import psycopg

from pgleaderlock.lowlevel import mask_dsn
from pgleaderlock.testing.candidate import (
    DSN_ENV,
    CandidateEvent,
    CandidateOptions,
    candidate_command,
    parse_event,
)
from pgleaderlock.testing.postgres import ThrowawayPostgres, find_pg_bin

HEALTH_INTERVAL_S = 1.0  # the leader probes its session this often
HEALTH_TIMEOUT_S = 2.0  # the library default
STALE_BOUND_S = HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S  # a leader notices a lost session by then
TIMEOUT_S = 30.0  # every wait of the parent is bounded by this
KILL_MESSAGES = {
    "sigkill": "killed with SIGKILL (its connection drops, the server frees the lock)",
    "terminate": "session terminated with pg_terminate_backend()",
    "sigterm": "sent SIGTERM (graceful: releases the lock, then exits)",
}


# ------------------------------------------------------------------ the parent


class DemoFailure(Exception):
    """An expectation of the demo failed (the demo then exits with status 1)."""


@dataclass
class Candidate:
    """A candidate process, as the parent sees it."""

    cid: int
    proc: subprocess.Popen[str]
    backend_pid: int | None = None
    seen: dict[str, float] = field(default_factory=dict)  # event name -> last timestamp
    expect_exit: bool = False
    gone: bool = False

    def __str__(self) -> str:
        return f"candidate-{self.cid} (pid {self.proc.pid})"


@dataclass
class Leadership:
    """A span of time during which a candidate believed it was leader."""

    cid: int
    start: float
    end: float | None = None


def ms(seconds: float) -> str:
    """Format a duration in milliseconds."""
    return f"{seconds * 1000:.0f} ms"


class Demo:
    """Runs the candidates, kills leaders and checks the takeovers."""

    def __init__(self, dsn: str, args: argparse.Namespace) -> None:
        self.dsn, self.args = dsn, args
        self.events: queue.Queue[tuple[int, CandidateEvent]] = queue.Queue()
        self.candidates: dict[int, Candidate] = {}
        self.leaderships: list[Leadership] = []
        self.acquired: list[tuple[int, float]] = []
        self.rows: list[tuple[str, ...]] = []
        self.failed = False
        self.t0 = time.monotonic()  # the candidates' clock too
        self.admin: psycopg.Connection[Any]  # set by run()

    def run(self) -> int:
        """Run the whole demo; return the exit status. Every candidate is gone afterwards."""
        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as admin:
                self.admin = admin  # for pg_terminate_backend()
                self.main()
        except DemoFailure as exc:
            print(f"\nFAILED: {exc}")
            return 1
        finally:
            self.stop_all()
        if self.failed:
            print("\nFAILED: two candidates believed they were leader at the same time")
        return 1 if self.failed else 0

    def main(self) -> None:
        """The scenario: elect, then kill the leader ``--rounds`` times, then stop."""
        version = self.admin.info.parameter_status("server_version")
        print(f"PostgreSQL {version} at {mask_dsn(self.dsn)}")
        print(
            "Followers wait on the server (follower_mode='wait', the default): PostgreSQL "
            "grants the lock\nto the first waiter the instant the leader's session ends. The "
            "leader watches its idle\nsession (a terminated backend is noticed within "
            f"milliseconds) and probes it every {HEALTH_INTERVAL_S:g} s.\n"
        )
        self.t0 = time.monotonic()
        self.log(self.t0, "parent", f"starting {self.args.candidates} candidates")
        for _ in range(self.args.candidates):
            self.spawn()
        self.wait_until(lambda: bool(self.acquired), "a first leader")
        cid, ts = self.acquired[0]
        took = ms(ts - self.t0)
        print(
            f"==> first leader: {self.candidates[cid]}, {took} after start (with Python start-up)"
        )
        self.wait_until(lambda: all("ready" in c.seen for c in self.live()), "the followers")
        self.pause(1.0)
        self.check_overlap(since=self.t0)
        for number in range(1, self.args.rounds + 1):
            self.round(number)
        self.stop_gracefully()
        print("\nSummary")
        header = ("round", "kill", "old leader", "new leader", "failover", "overlap")
        for row in [header, *self.rows]:
            print(f"  {row[0]:<6}{row[1]:<10}{row[2]:<26}{row[3]:<26}{row[4]:>8}  {row[5]}")

    def spawn(self) -> Candidate:
        """Start one candidate process and a thread that forwards its JSON lines."""
        cid = len(self.candidates) + 1
        options = CandidateOptions.library_defaults(
            health_interval_s=HEALTH_INTERVAL_S, health_timeout_s=HEALTH_TIMEOUT_S, quiet=True
        )
        cmd = candidate_command(
            lock_name=self.args.lock_name, name=f"candidate-{cid}", options=options
        )
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, DSN_ENV: self.dsn},
            start_new_session=True,  # Ctrl-C goes to the parent only, which stops them
        )
        self.candidates[cid] = candidate = Candidate(cid, proc)
        threading.Thread(target=self.forward, args=(cid, proc), daemon=True).start()
        return candidate

    def forward(self, cid: int, proc: subprocess.Popen[str]) -> None:
        """Reader thread: a candidate's stdout lines become events on the queue."""
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                text = {"text": line.rstrip()}
                event = parse_event(line) or CandidateEvent(time.monotonic(), "output", None, text)
                self.events.put((cid, event))
        self.events.put((cid, CandidateEvent(time.monotonic(), "eof", None)))

    def handle(self, cid: int, ev: CandidateEvent) -> None:
        """Record one event and print it."""
        c, kind, ts = self.candidates[cid], ev.event, ev.t
        c.seen[kind] = ts
        c.backend_pid = ev.backend_pid or c.backend_pid
        if kind == "state":  # the leadership spans; the callbacks print the news
            if ev.data.get("new") == "leader":
                self.leaderships.append(Leadership(c.cid, ts))
            elif ev.data.get("old") == "leader":
                self.end_leadership(c, ts)
            return
        if kind in ("acquire_failed", "stopped"):  # a follower's attempts; the exit says it
            return
        if kind == "acquired":
            self.acquired.append((c.cid, ts))
        if kind == "eof":
            c.gone = True
            self.end_leadership(c, ts)
            if not c.expect_exit:
                raise DemoFailure(f"{c} exited unexpectedly (status {c.proc.poll()})")
            if "exit" in c.seen:
                return
        text = {
            "ready": "started, waiting for the lock",
            "acquired": f"ACQUIRED leadership (backend pid {c.backend_pid})",
            "lost": "LOST leadership: its session is gone",
            "released": "released leadership",
            "exit": "exited cleanly",
            "eof": "process gone",
        }.get(kind) or f"{kind}: {ev.data.get('error') or ev.data.get('text')}"
        self.log(ts, str(c), text)

    def log(self, ts: float, who: str, text: str) -> None:
        """Print one line with a timestamp relative to the start of the candidates."""
        print(f"  {ts - self.t0:+8.3f}s  {who:<26}{text}", flush=True)

    def end_leadership(self, c: Candidate, ts: float) -> None:
        """Close ``c``'s open leadership span, if any."""
        for span in self.leaderships:
            if span.cid == c.cid and span.end is None:
                span.end = ts

    def live(self) -> list[Candidate]:
        """The candidates whose process is still running."""
        return [c for c in self.candidates.values() if not c.gone]

    def leader(self) -> Candidate:
        """The one candidate that believes it is leader now."""
        leading = [span.cid for span in self.leaderships if span.end is None]
        if len(leading) != 1:
            raise DemoFailure(f"expected exactly one leader, found {len(leading)}")
        return self.candidates[leading[0]]

    def wait_until(self, done: Callable[[], bool], what: str) -> None:
        """Handle events until ``done()``; fail after TIMEOUT_S."""
        deadline = time.monotonic() + TIMEOUT_S
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DemoFailure(f"timed out after {TIMEOUT_S:g} s waiting for {what}")
            with contextlib.suppress(queue.Empty):
                self.handle(*self.events.get(timeout=min(remaining, 0.1)))

    def pause(self, seconds: float) -> None:
        """Let events happen (and print) for ``seconds``."""
        end = time.monotonic() + seconds
        self.wait_until(lambda: time.monotonic() >= end, "a pause")

    def round(self, number: int) -> None:
        """Kill the leader, time the takeover, check for overlapping leaderships."""
        old, mode = self.leader(), self.args.kill
        print(f"\n--- round {number}: {mode} the leader, {old} ---")
        seen_before = len(self.acquired)
        old.expect_exit = mode != "terminate"
        killed_at = time.monotonic()
        if mode == "sigkill":
            old.proc.kill()
            self.end_leadership(old, killed_at)  # a killed process believes nothing
        elif mode == "sigterm":
            old.proc.terminate()
        else:
            self.admin.execute("SELECT pg_terminate_backend(%s)", (old.backend_pid,))
        self.log(killed_at, str(old), KILL_MESSAGES[mode])

        def new_leader() -> tuple[int, float] | None:
            return next(((c, t) for c, t in self.acquired[seen_before:] if c != old.cid), None)

        self.wait_until(lambda: new_leader() is not None, "a follower to take over")
        new_cid, acquired_at = new_leader() or (0, 0.0)
        new = self.candidates[new_cid]
        print(f"==> takeover: {new} became leader {ms(acquired_at - killed_at)} after the kill")
        if mode == "terminate":
            self.wait_until(lambda: old.seen.get("lost", 0) > killed_at, "the old leader to notice")
            noticed = old.seen["lost"] - killed_at
            print(f"==> old leader noticed the loss {ms(noticed)} after the kill")
        else:
            self.wait_until(lambda: old.gone, "the old leader's process to end")
            old.proc.wait(TIMEOUT_S)
            if mode == "sigterm":
                released = ms(old.seen["released"] - killed_at)
                print(f"==> old leader released the lock {released} after SIGTERM")
            replacement = self.spawn()
            self.log(time.monotonic(), "parent", f"started replacement {replacement}")
        self.pause(1.0)
        overlap = self.check_overlap(
            since=killed_at, terminated=old if mode == "terminate" else None
        )
        failover = ms(acquired_at - killed_at)
        self.rows.append((str(number), mode, str(old), str(new), failover, overlap))

    def check_overlap(self, since: float, terminated: Candidate | None = None) -> str:
        """Print (and return) the overlap of leaderships that lasted past ``since``.

        A terminated leader goes on believing it leads until its next health probe: that
        stale belief is expected (the server freed the lock at once) if it ended in time.
        """
        now, spans = time.monotonic(), [s for s in self.leaderships if (s.end or since) >= since]
        result = "none"
        for a, b in itertools.combinations(spans, 2):
            a, b = sorted((a, b), key=lambda span: span.start)
            length = min(a.end or now, b.end or now) - b.start
            if length <= 0 or a.cid == b.cid:
                continue
            old, new = self.candidates[a.cid], self.candidates[b.cid]
            if terminated is old and a.end and a.end - since <= STALE_BOUND_S:
                result = f"stale {ms(length)}"
                print(f"==> overlap: {old} still believed it led for {ms(length)} after {new}")
                print("    took over: a stale belief (the server had freed the lock at the kill),")
                print(
                    f"    ended within health_interval_s + health_timeout_s = {STALE_BOUND_S:g} s"
                )
            else:
                result, self.failed = f"{ms(length)} (!)", True
                print(f"==> overlap: {old} and {new} both believed they led for {ms(length)}")
        if result == "none":
            print("==> overlap: none")
        return result

    def stop_gracefully(self) -> None:
        """Stop the followers first (no new elections), then the leader (which releases)."""
        print("\n--- stopping: followers first, then the leader ---")
        # A replacement started just now may not have its SIGTERM handler yet: a
        # signal then kills it at the default action, which is no graceful exit.
        self.wait_until(lambda: all("ready" in c.seen for c in self.live()), "the candidates")
        leader = self.leader()
        for group in ([c for c in self.live() if c is not leader], [leader]):
            for c in group:
                c.expect_exit = True
                c.proc.terminate()
            self.wait_until(lambda: all(c.gone for c in group), "the candidates to exit")  # noqa: B023
        if bad := [c for c in self.candidates.values() if c.proc.wait(TIMEOUT_S) not in (0, -9)]:
            raise DemoFailure(f"unclean exit of {', '.join(map(str, bad))}")

    def stop_all(self) -> None:
        """Last resort on every path: SIGTERM, then SIGKILL, and reap every candidate."""
        for c in self.candidates.values():
            c.expect_exit = True
            if c.proc.poll() is None:
                c.proc.terminate()
        for c in self.candidates.values():
            try:
                c.proc.wait(10)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
            if c.proc.stdin is not None:
                c.proc.stdin.close()


def start_throwaway() -> ThrowawayPostgres:
    """Start a private PostgreSQL cluster, saying where the binaries come from."""
    bin_dir = find_pg_bin()
    print(f"No --dsn and no $PG_DSN: starting a throwaway PostgreSQL from {bin_dir} ...")
    started = time.monotonic()
    pg = ThrowawayPostgres(bin_dir=bin_dir)
    pg.start()  # cleans up after itself if it fails
    print(f"Throwaway PostgreSQL ready in {time.monotonic() - started:.2f} s ({pg.data_dir})")
    return pg


def plain_text(markdown: str) -> str:
    """The module docstring as terminal text: code fences become indented lines, and
    Markdown code spans and mkdocstrings cross-references (``[`X`][pgleaderlock.X]``)
    become their plain text."""
    lines, in_code = [], False
    for line in markdown.strip().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        lines.append(f"    {line}" if in_code else line)
    text = "\n".join(lines)
    text = re.sub(r"\[([^\]]+)\]\[[^\]]*\]", r"\1", text)  # [label][target] -> label
    return re.sub(r"``?([^`]+)``?", r"\1", text)  # `code` and ``code`` -> code


def _interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m pgleaderlock.demo``."""
    parser = argparse.ArgumentParser(
        prog="python -m pgleaderlock.demo",
        description=plain_text(__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dsn_help = "default: $PG_DSN, else a throwaway PostgreSQL is started"
    parser.add_argument("--dsn", default=os.environ.get("PG_DSN"), help=dsn_help)
    parser.add_argument("--candidates", type=int, default=3, help="processes (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="leaders to kill (default 2)")
    parser.add_argument("--kill", choices=list(KILL_MESSAGES), default="sigkill")
    parser.add_argument("--lock-name", default="pgleaderlock-demo")
    args = parser.parse_args(argv)
    if args.candidates < 2 or args.rounds < 0:
        parser.error("--candidates must be at least 2 and --rounds at least 0")
    signal.signal(signal.SIGTERM, _interrupt)
    pg: ThrowawayPostgres | None = None
    try:
        if not args.dsn:
            pg = start_throwaway()
            args.dsn = pg.dsn
        return Demo(args.dsn, args).run()
    except KeyboardInterrupt:
        print("\nInterrupted: cleaned up.")
        return 130
    except (RuntimeError, psycopg.Error) as exc:
        print(f"FAILED: {exc}")
        return 1
    finally:
        if pg is not None:
            pg.close()
            print("Throwaway PostgreSQL stopped and removed.")


if __name__ == "__main__":
    sys.exit(main())
