"""Start and stop real memcached servers for the shared tier's tests and benchmarks: each on
a free loopback port, with extstore on a file under the given directory (items on disk,
keys and metadata in RAM), as a cache node runs it.

    with MemcachedServers(2, "/tmp/mc") as servers:
        print(servers.url)            # memcached://127.0.0.1:PORT,127.0.0.1:PORT
        servers.kill(0); servers.start(0)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

MEMORY_MB = 256  # RAM for the hash table, and room for writes until extstore has flushed them
EXTSTORE_MB = 1024  # extstore file per server
ITEM_MAX = "2m"  # a 1 MiB block and its header in one item


def available() -> bool:
    return shutil.which("memcached") is not None


def _free_ports(count: int) -> list[int]:
    """`count` distinct free ports: each socket is held until all are bound (one closed
    before the next bind can be handed out again, and two servers of one test got the
    same port)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def command(port: int, ext_path: str, memory_mb: int = MEMORY_MB, ext_mb: int = EXTSTORE_MB) -> list[str]:
    """The command line of one cache server (docs/admin.md explains each option)."""
    cmd = ["memcached", "-l", "127.0.0.1", "-p", str(port), "-U", "0", "-m", str(memory_mb), "-I", ITEM_MAX,
           "-c", "1024", "-t", "2",
           "-o", f"ext_path={ext_path}:{ext_mb}m,ext_wbuf_size=8,ext_threads=2,ext_item_size=512,"
                 "ext_item_age=0,ext_max_sleep=1000"]
    if os.geteuid() == 0:
        cmd[1:1] = ["-u", "root"]
    return cmd


class MemcachedServers:
    def __init__(self, count: int, workdir: str, memory_mb: int = MEMORY_MB):
        self.workdir = workdir
        self.memory_mb = memory_mb
        self.ports = _free_ports(count)
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * count

    @property
    def url(self) -> str:
        return "memcached://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, i: int) -> None:
        os.makedirs(self.workdir, exist_ok=True)
        ext = os.path.join(self.workdir, f"extstore-{i}")
        proc = subprocess.Popen(command(self.ports[i], ext, self.memory_mb), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        self.procs[i] = proc
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"memcached on port {self.ports[i]} exited with {proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.ports[i]), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"memcached on port {self.ports[i]} did not start")

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None:
            proc.kill()
            proc.wait()
            self.procs[i] = None

    def stop(self, i: int) -> None:
        """SIGSTOP: the server stops answering, its connections stay open."""
        proc = self.procs[i]
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)

    def cont(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> MemcachedServers:
        for i in range(len(self.ports)):
            self.start(i)
        return self

    def __exit__(self, *exc: object) -> None:
        for i, proc in enumerate(self.procs):
            if proc is not None:
                proc.send_signal(signal.SIGCONT)
                self.kill(i)
