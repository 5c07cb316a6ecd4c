"""A throwaway redis-server for tests: installed with apt when missing (CI runs as root on
Debian), started on a free loopback port in a temporary directory, stopped afterwards."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time


def ensure_installed() -> str | None:
    """The redis-server path, installing the Debian package if needed; None with the reason
    printed if that is impossible."""
    path = shutil.which("redis-server")
    if path:
        return path
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "install", "-y", "--no-install-recommends", "redis-server"],
                ["apt-get", "update"],
                ["apt-get", "install", "-y", "--no-install-recommends", "redis-server"]):
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        if cmd[1] == "install" and shutil.which("redis-server"):
            break
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, binary: str, workdir: str):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", workdir, "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
