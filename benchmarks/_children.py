"""Helper processes and threads of a benchmark end it with an error, never with a hang.

A benchmark that starts processes (a receiver, a coordinator) waits for each
with a deadline (`read_line`), and a process that serves from threads ends
when one of them fails (`exit_on_thread_error`), so the process waiting on it
sees it gone instead of waiting forever. `free_port` finds such a process a
port on localhost, and `cpu_seconds` reads what a process (this one or a helper)
has spent.
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
import time


def exit_on_thread_error() -> None:
    """Makes an exception that escapes any thread of this process end the process with status 1.

    The thread's traceback is printed to stderr first. Without this, a server
    thread that fails while starting leaves the thread that waits for it (and
    every process waiting on this one) waiting forever.
    """

    def hook(args: threading.ExceptHookArgs) -> None:
        threading.__excepthook__(args)
        print(f"{os.path.basename(sys.argv[0])}: thread {args.thread.name if args.thread else '?'} failed (above); "
              "exiting so that nothing waits on it", file=sys.stderr, flush=True)
        os._exit(1)

    threading.excepthook = hook


def read_line(proc: subprocess.Popen, prefix: str, timeout: float) -> str:
    """The first line of `proc`'s stdout (a text pipe) that starts with `prefix`; lines before it are echoed.

    Args:
      proc: a process started with `stdout=subprocess.PIPE, text=True`.
      prefix: what the awaited line starts with, e.g. "PORT ".
      timeout: how long to wait for it, seconds.

    Returns:
      The line, without its newline.

    Raises:
      RuntimeError: `proc` exited (its status and stderr tell why) or printed no such line within `timeout`
        seconds. `proc` is left running for the caller to stop.
    """
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        while True:
            line = proc.stdout.readline()
            lines.put(line)
            if not line or line.startswith(prefix):
                return

    threading.Thread(target=read, name=f"read {prefix.strip()}", daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            raise RuntimeError(
                f"{_name(proc)} printed no {prefix.strip()!r} line within {timeout:.0f} s; it is stuck: see its "
                "stderr above"
            ) from None
        if not line:
            try:
                status = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                status = "none yet: it closed its stdout"
            raise RuntimeError(
                f"{_name(proc)} exited (status {status}) before printing its {prefix.strip()!r} line; its error is "
                "in its stderr above"
            )
        if line.startswith(prefix):
            return line.rstrip("\n")
        print(line, end="", flush=True)


def _name(proc: subprocess.Popen) -> str:
    args = proc.args if isinstance(proc.args, list) else [str(proc.args)]
    return "the helper process " + " ".join(os.path.basename(str(a)) if i == 0 else str(a) for i, a in enumerate(args))


def free_port() -> int:
    """A TCP port on localhost that is free now (the OS picks it), for a helper process to listen on."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds (every thread) of this process, or of process `pid` (from /proc; NaN where there
    is none)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
