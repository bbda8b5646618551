"""Runs the processes of a run on one machine, and starts them again when they fail (`launch/local.py`).

A `Role` is one process: its command line, environment, CPUs and network namespace. The `Supervisor` starts
every role, forwards their output line by line prefixed with the role's name (`[island a] ...`), prints the
progress lines it is given, starts a role that exits with a non-zero status or a signal again (up to
`restarts` times per role) and, once one fails beyond that or on Ctrl-C, stops all of them: SIGTERM, then
SIGKILL after `grace` seconds. Roles of one `group` (the processes of an island of several, the shards of a
coordinator of several) are one unit: when one of them fails, the others are stopped, and they all start
again together, counted as one restart of the group. Every child dies with the launcher (Linux
PR_SET_PDEATHSIG), so no role outlives it. Standard library only: no JAX in the supervising process.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TextIO


@dataclasses.dataclass(frozen=True)
class Role:
    """One process of a run, as the supervisor starts it (and starts it again).

    Attributes:
      name: "coordinator", "coordinator/K" (shard K of a coordinator of several), "island NAME" or
        "island NAME/I" (process I of an island of several): how its lines and the launcher's lines name it.
      command: the command line.
      env: its environment; None: the launcher's.
      cpus: CPUs it is kept to (Linux sched_setaffinity); None: any.
      netns: the network namespace the command enters (shown in the started line only; `command` enters it).
      group: "island NAME" for each process of an island of several processes, "coordinator" for each shard
        of a coordinator of several ("" otherwise): when one of them fails, the others are stopped, and they
        are restarted together (counted once, under the group).
    """

    name: str
    command: list[str]
    env: dict[str, str] | None = None
    cpus: frozenset[int] | None = None
    netns: str = ""
    group: str = ""  # the processes of one island (or coordinator) of several share it: they restart together


def _die_with_parent() -> None:
    """In the child: receive SIGTERM if the launcher dies, so no role outlives it (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _start_role(cpus: frozenset[int] | None) -> None:
    """In the child, before it runs the role: die with the launcher, and keep to `cpus` when given."""
    _die_with_parent()
    if cpus:
        os.sched_setaffinity(0, cpus)


class _Output:
    """A role's output pipe, forwarded line by line with the role's prefix."""

    def __init__(self, role: str, pipe):
        self.role, self.pipe, self.rest = role, pipe, b""
        os.set_blocking(pipe.fileno(), False)

    def read(self, write: Callable[[str], None]) -> bool:
        """Forwards the complete lines in the pipe now; False at its end (after the last line, if unfinished)."""
        while True:
            try:
                data = os.read(self.pipe.fileno(), 1 << 16)
            except BlockingIOError:
                return True
            *lines, self.rest = (self.rest + data).split(b"\n")
            if not data and self.rest:
                lines, self.rest = [*lines, self.rest], b""
            for line in lines:
                write(f"[{self.role}] {line.decode('utf-8', 'replace')}\n")
            if not data:
                return False


class Supervisor:
    """Runs the roles of a run, once: starts them, forwards their output prefixed with their names, prints the
    progress lines, starts a role that exits abnormally again (up to `restarts` times per role) and, once
    one fails beyond that or on Ctrl-C, stops all of them. One thread: the output pipes are read with a
    selector between the checks, so a restarted role's output is followed like the first one's, and
    `preexec_fn` (CPU pinning, dying with the launcher) runs in a process without threads.

    Args:
      roles: the processes to run, started in this order.
      restarts: times each role may be started again after exiting with a non-zero status or a signal;
        0: stop every process at the first failure. A role that exits with status 0 is done.
      out: where the lines go (default: sys.stdout at `run`).
      interval: seconds between the progress polls and the checks of the processes.
      grace: seconds the stopped processes get to end after SIGTERM, before SIGKILL.
    """

    def __init__(self, roles: list[Role], restarts: int = 0, out: TextIO | None = None, interval: float = 0.5,
                 grace: float = 10.0):
        if restarts < 0:
            raise ValueError(f"restarts is {restarts}; it must be 0 or more")
        self.roles = {r.name: r for r in roles}
        self.restarts, self.out, self.interval, self.grace = restarts, out, interval, grace
        self.procs: dict[str, subprocess.Popen] = {}
        self.outputs: dict[str, _Output] = {}  # the newest process's output of each role
        self.restarted = dict.fromkeys((r.group or r.name for r in roles), 0)  # per role, or per island group
        self.selector = selectors.DefaultSelector()

    def run(self, progress: Callable[[], list[str]] = list) -> tuple[str, int] | None:
        """Starts every role and supervises them until all have ended. `progress()` gives the progress lines
        to print since its last call (polled every `interval` and once more at the end of a run that
        succeeded). Returns None when every role ended with status 0, else (role, status) of the failure
        that stopped the run: ("launch", 130) on Ctrl-C, and a negative status for a signal."""
        self.out = self.out or sys.stdout
        failed = None
        try:
            for role in self.roles.values():  # every process first, then the loop
                proc = self._spawn(role)
                inside = f" in namespace {role.netns}" if role.netns else ""
                on = f" on CPUs {','.join(map(str, sorted(role.cpus)))}" if role.cpus else ""
                self._say(f"started {role.name} (pid {proc.pid}){inside}{on}")
            while failed is None and not all(p.poll() == 0 for p in self.procs.values()):  # a failure: to _check
                self._pump(self.interval)
                self._progress(progress)
                failed = self._check()
            if failed is None:
                self._progress(progress)
        except KeyboardInterrupt as e:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal (schedulers repeat it) stops nothing
            signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
            failed = ("launch", 128 + signum)
            self._say("interrupted; stopping every process" if signum == signal.SIGINT else
                      f"{signal.Signals(signum).name}: stopping every process (each finishes the checkpoint it "
                      f"is writing, for up to {self.grace:g} s)")
        finally:
            self._stop()
            self._pump(5.0, until_quiet=True)
            self.selector.close()
        return failed

    def _spawn(self, role: Role) -> subprocess.Popen:
        proc = subprocess.Popen(role.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=role.env,
                                preexec_fn=functools.partial(_start_role, role.cpus))
        self.procs[role.name] = proc
        self.outputs[role.name] = _Output(role.name, proc.stdout)
        self.selector.register(proc.stdout, selectors.EVENT_READ, self.outputs[role.name])
        return proc

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _say(self, line: str) -> None:
        self._write(f"[launch] {line}\n")

    def _progress(self, progress: Callable[[], list[str]]) -> None:
        counts = ", ".join(f"{role} {n}" for role, n in self.restarted.items() if n)
        for line in progress():
            self._say(line + (f" | restarts: {counts}" if counts else ""))

    def _forward(self, output: _Output) -> bool:
        """The pipe's complete lines now; False (and it is closed) at its end."""
        if output.read(self._write):
            return True
        self.selector.unregister(output.pipe)
        output.pipe.close()
        return False

    def _pump(self, seconds: float, until_quiet: bool = False) -> None:
        """Forwards output for `seconds`, or until a pipe ends (a process probably did), or with
        `until_quiet` until every pipe has ended."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.selector.get_map():
                if until_quiet:
                    return
                time.sleep(left)
                return
            ended = [key.data for key, _ in self.selector.select(left) if not self._forward(key.data)]
            if ended and not until_quiet:
                return

    def _check(self) -> tuple[str, int] | None:
        """Restarts the roles that failed with restarts left; the first failure beyond them, if any."""
        exited = [(role, p.returncode) for role, p in self.procs.items() if p.poll() is not None]
        failures = [(role, code) for role, code in exited if code != 0]
        for role, _ in failures:  # their last lines come before the launcher's line about them
            if not self.outputs[role].pipe.closed:
                self._forward(self.outputs[role])
        fatal = [(role, code) for role, code in failures if self.restarted[self._unit(role)] >= self.restarts]
        if fatal:
            for role, code in failures:
                self._say(f"{role} exited with status {code}; stopping the other processes")
            return fatal[0]
        failed = dict(failures)
        for unit in dict.fromkeys(self._unit(role) for role in failed):
            self.restarted[unit] += 1
            members = [name for name, r in self.roles.items() if (r.group or name) == unit]
            others = [name for name in members if name not in failed]
            if others:  # the processes of one group restart together
                self._say(f"{', '.join(n for n in members if n in failed)} of {unit} failed; stopping its other "
                          f"processes ({', '.join(others)})")
                self._stop(others)
            for name in members:
                proc = self._spawn(self.roles[name])
                why = f"exited with status {failed[name]}" if name in failed else "was stopped with it"
                self._say(f"{name} {why}; restarting it (restart {self.restarted[unit]} of {self.restarts}, "
                          f"pid {proc.pid})")
        return None

    def _unit(self, role: str) -> str:
        """What restarts as one: the role, or the island (or coordinator) whose process it is."""
        return self.roles[role].group or role

    def _stop(self, names: list[str] | None = None) -> None:
        """SIGTERM to every process (of `names`, default all) still running; SIGKILL to those still running
        `grace` seconds later."""
        procs = [p for name, p in self.procs.items() if names is None or name in names]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + self.grace
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

