"""`pdserve serve` as a process, each with its own local Ray: mistakes in --model and ports fail before Ray
starts with one line, two servers with default ports share a host, and a SIGKILLed server leaves no process of
its Ray behind (its process tree, recorded while it served, is identified by pid and start time, so that the
other Ray clusters on this machine are left alone)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from serving import is_loopback_hex, listening, sockets_of, wait_for

from pdserve.cli.client import Client, generate_request
from pdserve.cluster.reaper import OWNER_ENV

# `pdserve serve` processes, each with a Ray of its own
pytestmark = pytest.mark.ray

CLI = [sys.executable, "-m", "pdserve.cli.main"]
_READY = re.compile(r"ready: `pdserve generate --addr (\S+) ")


@pytest.fixture
def ray_tmpdir():
    """A short private Ray temp dir (Ray's socket paths must stay under ~107 bytes): a session dir appears in it
    once Ray starts."""
    path = Path(tempfile.mkdtemp(prefix="pdt", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def serve_env(ray_tmpdir: Path) -> dict[str, str]:
    # RAY_AUTH_MODE: this process's ray.init exported it; a user's shell has none
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["RAY_TMPDIR"] = str(ray_tmpdir)
    # As when this test process started a Ray of its own first: the server inherits that Ray's owner token and
    # must still tie its own Ray to itself.
    env[OWNER_ENV] = "1-inherited"
    return env


def ray_started(ray_tmpdir: Path) -> bool:
    return any(ray_tmpdir.rglob("session_*"))


def run_serve(ray_tmpdir: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, "serve", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=serve_env(ray_tmpdir),
    )


def assert_fails_before_ray(
    out: subprocess.CompletedProcess, ray_tmpdir: Path, prefix: str
) -> None:
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {prefix}"), out.stderr
    assert not ray_started(ray_tmpdir), "Ray started before the error"


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_bad_model_fails_before_ray(ray_tmpdir, tmp_path):
    out = run_serve(ray_tmpdir, "--model", str(tmp_path / "missing"))
    assert_fails_before_ray(out, ray_tmpdir, f"--model {tmp_path / 'missing'}: not a checkpoint")
    (tmp_path / "empty").mkdir()
    out = run_serve(ray_tmpdir, "--model", str(tmp_path / "empty"))
    assert_fails_before_ray(
        out, ray_tmpdir, f"{tmp_path / 'empty' / 'config.json'}: no config.json"
    )


def test_checkpoint_without_weights_fails_before_ray(ray_tmpdir, tmp_path, model_dir):
    (tmp_path / "ck").mkdir()
    shutil.copy(model_dir / "config.json", tmp_path / "ck")
    out = run_serve(ray_tmpdir, "--model", str(tmp_path / "ck"))
    assert_fails_before_ray(out, ray_tmpdir, str(tmp_path / "ck"))
    assert "model.safetensors" in out.stderr


def test_busy_ports_fail_before_ray(ray_tmpdir, model_dir, busy_port):
    out = run_serve(ray_tmpdir, "--model", str(model_dir), "--port", str(busy_port))
    assert_fails_before_ray(out, ray_tmpdir, f"--port {busy_port}: cannot listen")
    out = run_serve(
        ray_tmpdir, "--model", str(model_dir), "--port", "0", "--http-port", str(busy_port)
    )
    assert_fails_before_ray(out, ray_tmpdir, f"--http-port {busy_port}: cannot listen")
    out = run_serve(
        ray_tmpdir,
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--kvtransfer.store-port",
        str(busy_port),
    )
    assert_fails_before_ray(out, ray_tmpdir, f"--kvtransfer.store-port {busy_port}: cannot host")


def test_open_host_without_a_key_fails_before_ray(ray_tmpdir, model_dir):
    out = run_serve(ray_tmpdir, "--model", str(model_dir), "--port", "0", "--host", "0.0.0.0")
    assert_fails_before_ray(
        out, ray_tmpdir, "--host 0.0.0.0: listening beyond loopback with no API key"
    )
    assert "--insecure" in out.stderr


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process; None if gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return None if fields[0] in ("Z", "X") else (int(fields[1]), int(fields[19]))


def process_tree(root: int) -> set[tuple[int, int]]:
    """(pid, start time) of root's live descendants."""
    parents: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            parents.setdefault(stat[0], []).append((int(entry), stat[1]))
    tree, todo = set(), [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            tree.add(child)
            todo.append(child[0])
    return tree


def alive(processes: set[tuple[int, int]]) -> set[tuple[int, int]]:
    return {(pid, start) for pid, start in processes if (s := _stat(pid)) and s[1] == start}


def raylets(processes: set[tuple[int, int]]) -> set[tuple[int, int]]:
    found = set()
    for pid, start in processes:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"/raylet"):
                found.add((pid, start))
        except OSError:  # exited meanwhile
            continue
    return found


class ServeProcess:
    """`pdserve serve` on free ports in its own session; `address` once it logged ready."""

    def __init__(self, model_dir: Path, ray_tmpdir: Path, log: Path, *flags: str):
        self.log = log
        self.proc = subprocess.Popen(
            [*CLI, "serve", "--model", str(model_dir), "--dtype", "fp32", "--port", "0",
             "--http-port", "0", "--cluster.cpus-per-worker", "0.25", *flags],
            stdout=subprocess.DEVNULL, stderr=log.open("w"), env=serve_env(ray_tmpdir),
            start_new_session=True,
        )  # fmt: skip
        self.tree: set[tuple[int, int]] = set()

    def wait_ready(self, timeout_s: float = 180.0) -> str:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"serve exited {self.proc.returncode}:\n{self.log.read_text()}"
                )
            return _READY.search(self.log.read_text())

        self.address = wait_for(ready, timeout_s, "pdserve serve ready", interval_s=0.5).group(1)
        self.tree = process_tree(self.proc.pid)
        return self.address

    def kill(self) -> None:
        """SIGKILL, then (cleanup of a failed test) any process of its tree still alive."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        for pid, _ in alive(self.tree):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def servers(model_dir, ray_tmpdir, tmp_path):
    started: list[ServeProcess] = []

    def start(*flags: str) -> ServeProcess:
        log = tmp_path / f"serve{len(started)}.log"
        started.append(ServeProcess(model_dir, ray_tmpdir, log, *flags))
        return started[-1]

    yield start
    for server in started:
        server.kill()


def greedy_tokens(address: str, prompt: list[int]) -> list[int]:
    request = generate_request(prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
    with Client(address) as client:
        return [t for chunk in client.generate(request, timeout_s=60) for t in chunk.token_ids]


def listening_in(server: ServeProcess) -> dict[int, str]:
    """Port -> local address (/proc's hex) of every TCP socket the server and its process tree listen on."""
    sockets = listening()
    pids = {server.proc.pid} | {pid for pid, _ in alive(server.tree)}
    return {
        sockets[inode][1]: sockets[inode][0]
        for pid in pids
        for inode in sockets_of(pid) & sockets.keys()
    }


def test_two_servers_share_a_host_and_sigkill_leaves_no_ray_behind(servers, reference):
    # the second listens on every interface, open on purpose (--insecure): it says so
    first, second = servers(), servers("--host", "0.0.0.0", "--insecure")
    for server in (first, second):
        server.wait_ready()
        assert raylets(server.tree), server.tree  # a real Ray runs under it
        # Disaggregated (one prefill, one decode worker): the KV pages travel through this server's store.
        assert greedy_tokens(server.address, [0, 5, 6, 7]) == reference([0, 5, 6, 7], 4)
    assert not first.tree & second.tree
    # Everything the default server and its embedded Ray open listens on loopback (Ray's ports, its
    # autoscaler's metrics port among them); the open one's own ports listen everywhere, its Ray's do not.
    first_ports = listening_in(first)
    assert len(first_ports) > 3, first_ports  # gRPC, HTTP, the KV store, and Ray's
    assert all(is_loopback_hex(h) for h in first_ports.values()), first_ports
    port = int(second.address.rsplit(":", 1)[1])
    second_ports = listening_in(second)
    assert not is_loopback_hex(second_ports[port]), second_ports
    open_ports = {p for p, h in second_ports.items() if not is_loopback_hex(h)}
    assert len(open_ports) == 2, second_ports  # gRPC and HTTP
    warning = [line for line in second.log.read_text().splitlines() if "--insecure: open" in line]
    assert len(warning) == 1 and "WARNING" in warning[0] and f"gRPC 0.0.0.0:{port}" in warning[0]
    assert "--insecure" not in first.log.read_text()

    first.proc.send_signal(signal.SIGKILL)
    wait_for(
        lambda: not alive(first.tree),
        20,
        f"no process of the killed server's Ray left: {first.tree}",
    )
    assert second.proc.poll() is None and alive(
        raylets(second.tree)
    )  # the other one's Ray untouched
    assert greedy_tokens(second.address, [0, 9, 8]) == reference([0, 9, 8], 4)
