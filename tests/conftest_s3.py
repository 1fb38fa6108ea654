"""A real S3 endpoint on loopback for tests: ``moto_server`` in a child process, and a fault proxy.

Nothing is mocked: pyarrow, mosaic's boto3 client and Ray's workers talk HTTP to 127.0.0.1 on a
port the OS picks (servers bind port 0 and read it back). ``moto_s3`` (session-scoped, registered by conftest.py) starts the server once,
sets fake credentials in the environment (``s3_env``, before the shared ``ray.init``, so workers inherit
them) and stops it at the end::

    def test_x(moto_s3):
        moto_s3.make_bucket("b")
        moto_s3.upload_dir(local_dir, "b/prefix")
        cfg.storage = StorageConfig(endpoint_url=moto_s3.endpoint)

:class:`FaultProxy` sits between a client and the server and injects 503 SlowDown replies, responses
cut off halfway through the body, and a full outage (listener closed, connections dropped, then the
same port reopened), to show reads retry and finish.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

FAKE_KEY_ID = "AKIAPIPELINESTEST01"
FAKE_SECRET = "pipelines-test-secret-DO-NOT-LOG-9f8e7d"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_from_log(log: Path, proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """The port a server started with port 0 reports (werkzeug: ``Running on http://127.0.0.1:PORT``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"Running on http://127\.0\.0\.1:(\d+)", log.read_text(errors="replace"))
        if found:
            port = int(found.group(1))
            socket.create_connection(("127.0.0.1", port), 5).close()
            return port
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"moto_server did not report its port within {timeout}s")


class MotoServer:
    """``moto_server`` on 127.0.0.1:<free port>; ``env`` adds variables (e.g. to enforce auth)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        exe = Path(sys.executable).with_name("moto_server")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
        self.log = tempfile.NamedTemporaryFile(prefix="moto_server.", suffix=".log", delete=False)  # noqa: SIM115
        # Port 0: the OS picks a free port when the server binds, and the server's log says which.
        self.proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", "0"], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.port = _port_from_log(Path(self.log.name), self.proc)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def fs(self):
        """A pyarrow S3 filesystem on this server, allowed to create buckets (test setup only)."""
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{self.port}", scheme="http", region=REGION,
                                 access_key=FAKE_KEY_ID, secret_key=FAKE_SECRET, allow_bucket_creation=True)

    def make_bucket(self, name: str) -> str:
        self.fs().create_dir(name)
        return f"s3://{name}"

    def upload_dir(self, local: Path, dest: str) -> str:
        """Copy a local directory tree to ``bucket/prefix``; returns its ``s3://`` URL."""
        import pyarrow.fs as pafs

        pafs.copy_files(str(local), dest, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs())
        return f"s3://{dest}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture(scope="session")
def s3_env():
    """Fake S3 credentials in the environment for the whole run (no real credentials ever reach a test).

    Session-wide and requested by ``ray_local`` too, so they are in place before the shared Ray starts
    and its workers inherit them, whichever test starts Ray first.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
        mp.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
        mp.setenv("AWS_REGION", REGION)
        mp.setenv("AWS_DEFAULT_REGION", REGION)
        mp.delenv("AWS_PROFILE", raising=False)
        mp.delenv("AWS_ENDPOINT_URL", raising=False)
        mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        yield


@pytest.fixture(scope="session")
def moto_s3(s3_env):
    """A session-wide moto S3 server on loopback, with fake credentials in the environment."""
    server = MotoServer()
    yield server
    server.stop()


# --------------------------------------------------------------------------- fault injection


@dataclass
class FaultPlan:
    """Which requests for shard files (``/shard.`` in the path) fail, by their 1-based count.

    Example, the default: GET 2 gets a 503 SlowDown, GET 3 is cut off after half its body, every
    4th GET after that too; after GET ``outage_after`` the proxy goes away for ``outage_s`` seconds.
    """

    slow_down: set[int] = field(default_factory=lambda: {2, 6, 10, 14})
    cut: set[int] = field(default_factory=lambda: {3, 7, 11, 15})
    outage_after: int = 8
    outage_s: float = 1.5


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream`` that injects the faults of a :class:`FaultPlan`."""

    def __init__(self, upstream_port: int, plan: FaultPlan | None = None) -> None:
        self.upstream_port, self.plan = upstream_port, plan or FaultPlan()
        self.port = 0  # the first listener binds port 0; its port is read back and reused after an outage
        self.lock = threading.Lock()
        self.shard_gets = 0
        self.injected = {"slow_down": 0, "cut": 0, "outage": 0}
        self.gets_after_outage = 0
        self._outage_done = False
        self._conns: set[socket.socket] = set()
        self._start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    # -- server lifecycle -------------------------------------------------------------------
    def _start(self) -> None:
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        with self.lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:  # a stopped server drops its keep-alive connections too
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def _outage(self) -> None:
        self._stop()
        time.sleep(self.plan.outage_s)
        self._start()

    def close(self) -> None:
        self._stop()

    # -- per request ------------------------------------------------------------------------
    def decide(self, method: str, path: str) -> str:
        if method != "GET" or "/shard." not in path:
            return "pass"
        with self.lock:
            self.shard_gets += 1
            k = self.shard_gets
            if self._outage_done:
                self.gets_after_outage += 1
        if k in self.plan.slow_down:
            self.injected["slow_down"] += 1
            return "slow_down"
        if k in self.plan.cut:
            self.injected["cut"] += 1
            return "cut"
        if k == self.plan.outage_after and not self._outage_done:
            self._outage_done = True
            self.injected["outage"] += 1
            return "outage"
        return "pass"


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy

    def log_message(self, *args) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        with self.owner.lock:
            self.owner._conns.add(self.connection)

    def finish(self) -> None:
        with self.owner.lock:
            self.owner._conns.discard(self.connection)
        super().finish()

    def _forward(self) -> None:
        try:
            self._relay()
        except (BrokenPipeError, ConnectionResetError):  # the client hung up (e.g. while retrying)
            self.close_connection = True

    def _relay(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        action = self.owner.decide(self.command, self.path)
        if action == "slow_down":
            msg = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)
            return
        conn = http.client.HTTPConnection("127.0.0.1", self.owner.upstream_port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                self.send_header(k, v)
        # HEAD: the object's length as the server said; otherwise the length of the body we send.
        self.send_header("Content-Length", resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if action == "cut" and len(data) > 1:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(data)
        if action == "outage":
            self.wfile.flush()
            threading.Thread(target=self.owner._outage, daemon=True).start()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward
