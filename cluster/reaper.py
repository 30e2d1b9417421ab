"""Ties a local Ray that this process starts to this process's life, however it ends (`kill -9` included).

`ray.init` makes its head processes (GCS, raylet) die with their driver, but the raylet's children, the dashboard
and runtime-env agents, notice their raylet's death and then wait on the dead GCS for about a minute before they
exit. So before Ray starts, `tie_ray_to_this_process` marks this process's environment with a token, which every
process of the Ray it starts inherits (the raylet passes its environment on to the agents and workers), and starts
a watchdog: this file run as a script (stdlib only, so it starts in milliseconds). The watchdog blocks reading a
pipe whose only write end this process holds; the kernel closes it when this process ends, and the watchdog then
SIGKILLs every process of this user whose environment carries the token, until none is left. The agents retitle
themselves (`ray::DashboardAgent`), which overwrites what /proc shows of their environment, so while the owner
lives the watchdog also notes the owner's descendants every half second (pid and start time, so that a reused pid
is never taken for one of them) and kills those too.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
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
_SNAPSHOT_S = 0.5
"""How often the watchdog notes the owner's descendants while the owner lives."""


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


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = (
                f.read().rsplit(b")", 1)[1].split()
            )  # after the command name, which may hold spaces
    except OSError:
        return None
    return int(fields[1]), int(fields[19])


def _descendants(root: int) -> set[tuple[int, int]]:
    """(pid, start time) of root's live descendants."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(stat[0], []).append((int(entry), stat[1]))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child[0])
    return found


def _watch(token: str) -> None:
    owner = int(token.split("-", 1)[0])
    noted: set[tuple[int, int]] = set()
    while True:  # until EOF on stdin: the owner has ended
        readable, _, _ = select.select([sys.stdin.buffer], [], [], _SNAPSHOT_S)
        if readable and not os.read(sys.stdin.fileno(), 4096):
            break
        noted |= {d for d in _descendants(owner) if d[0] != os.getpid()}  # not this watchdog
    deadline, quiet = time.monotonic() + _SWEEP_S, 0
    while quiet < _QUIET_SWEEPS and time.monotonic() < deadline:
        pids = _marked_pids(token)
        pids += [pid for pid, start in noted if (s := _stat(pid)) is not None and s[1] == start]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.kill(pid, signal.SIGKILL)
        quiet = 0 if pids else quiet + 1
        time.sleep(0.2)


if __name__ == "__main__":
    _watch(sys.argv[1])
