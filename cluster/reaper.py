"""Ties a local Ray that this process starts to this process's life, however it ends (`kill -9` included).

`ray.init` makes its head processes (GCS, raylet) die with their driver, but the raylet's children, the dashboard
and runtime-env agents, notice their raylet's death and then wait on the dead GCS for about a minute before they
exit. So before Ray starts, `tie_ray_to_this_process` marks this process's environment with a token, which every
process of the Ray it starts inherits (the raylet passes its environment on to the agents and workers), and starts
a watchdog: this file run as a script (stdlib only, so it starts in milliseconds). The watchdog blocks reading a
pipe whose only write end this process holds; the kernel closes it when this process ends, and the watchdog then
SIGKILLs every process of this user whose environment carries the token, until none is left.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time

OWNER_ENV = "PDSERVE_RAY_OWNER"
"""The environment variable that marks the processes of a Ray started by one pdserve process."""
_SWEEP_S = 30.0
"""How long the watchdog keeps sweeping for marked processes (ones still being spawned as it starts)."""
_QUIET_SWEEPS = 3
"""Sweeps in a row that find nothing before the watchdog is done."""


def tie_ray_to_this_process() -> None:
    """Marks this process's environment and starts the watchdog. Call before `ray.init` starts a local Ray; a
    second call in the same process does nothing. The pipe's write end is kept open, unreferenced, for the rest of
    this process's life: its closing by the kernel is the watchdog's signal.

    A token inherited from a parent (a `pdserve serve` started by a process that started a Ray of its own, as the
    tests do) is replaced: this process's Ray must die with this process, not only with the parent."""
    if not sys.platform.startswith("linux"):  # the watchdog reads /proc
        return
    if os.environ.get(OWNER_ENV, "").startswith(f"{os.getpid()}-"):  # tied already
        return
    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    # Both ends are close-on-exec: Ray's processes do not inherit the write end.
    read_end, write_end = os.pipe()
    # Its own session: a Ctrl-C to the owner's terminal or a kill of the owner's process group spares it.
    subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), token],
        stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    os.close(read_end)
    os.environ[OWNER_ENV] = token
    del write_end  # the fd stays open: see the docstring


def _marked_pids(token: str) -> list[int]:
    """Processes of this user whose initial environment holds OWNER_ENV=token."""
    needle = f"{OWNER_ENV}={token}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:  # gone meanwhile, or another user's
            continue
    return pids


def _watch(token: str) -> None:
    sys.stdin.buffer.read()  # returns at EOF: the owner has ended
    deadline, quiet = time.monotonic() + _SWEEP_S, 0
    while quiet < _QUIET_SWEEPS and time.monotonic() < deadline:
        pids = _marked_pids(token)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.kill(pid, signal.SIGKILL)
        quiet = 0 if pids else quiet + 1
        time.sleep(0.2)


if __name__ == "__main__":
    _watch(sys.argv[1])
