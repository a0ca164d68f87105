"""A throwaway ``redis-server``: real Redis on a free port, no persistence (tests and benchmarks).

Tests use a real server rather than a fake so that the Lua scripts, key expiry
and reconnects are the ones production runs.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process; ``stop``/``start`` keep the port, to test a Redis restart."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._dir = tempfile.mkdtemp(prefix="tandem-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 5.0) -> RedisServer:
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self._proc = subprocess.Popen(cmd, cwd=self._dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not _ping(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port}")
            time.sleep(0.01)
        return self

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing answers, as with a hung node."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.kill()
        self._proc.wait(timeout=5)
        self._proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":  # a quick manual server: python -m tandem.redis_server
    with RedisServer() as server:
        print(server.url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
