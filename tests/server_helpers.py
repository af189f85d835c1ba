"""Test helper: ``kvchat serve`` as a real child process on loopback, and the real ``openai`` client on it."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from process_helpers import RUN_KVCHAT

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "test-key-123"
MESSAGE_COUNT = "SELECT COUNT(*) FROM messages"  # for Server.query: a refused request stores nothing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``kvchat serve --port P --api-key KEY ARGS`` on data dir ``home``; ``start`` waits for ``/health``.

    ``api_key=None``: no ``--api-key`` (loopback without a key)."""

    def __init__(self, home: Path, *args: str, env: dict | None = None, api_key: str | None = API_KEY):
        self.home, self.args, self.env, self.api_key = home, args, env or {}, api_key
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180) -> "Server":
        env = {**os.environ, "KVCHAT_HOME": str(self.home), **self.env}
        self.log = open(self.home.parent / f"serve-{self.port}.log", "a")
        self.proc = subprocess.Popen([sys.executable, "-c", RUN_KVCHAT, "serve", "--port", str(self.port),
                                      *(["--api-key", self.api_key] if self.api_key else []),
                                      "--threads", "1", *self.args],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvchat serve exited with {self.proc.returncode}: {self.read_log()}")
            try:
                self.health()
                return self
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"kvchat serve did not answer /health: {self.read_log()}")

    def read_log(self) -> str:
        return (self.home.parent / f"serve-{self.port}.log").read_text()

    def health(self, key: bool = True) -> dict:
        """``/health``, with the API key unless ``key`` is False."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if key and self.api_key else {}
        with urllib.request.urlopen(urllib.request.Request(self.url + "/health", headers=headers), timeout=5) as r:
            return json.loads(r.read())

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """(status, parsed JSON body, headers) of a raw request (auth header included unless given)."""
        hdrs = {"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json", **(headers or {})}
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={k: v for k, v in hdrs.items() if v is not None})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read()), r.headers
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        """The rows of ``sql`` on the server's database (its own connection, closed after)."""
        db = sqlite3.connect(self.home / "kvchat.db")
        try:
            return db.execute(sql, params).fetchall()
        finally:
            db.close()

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=120, **kw)

    def wait_idle(self, timeout: float = 60) -> dict:
        """Health once no request runs or waits."""
        deadline = time.time() + timeout
        while True:
            h = self.health()
            if (h["running"], h["queued"]) == (0, 0) or time.time() > deadline:
                return h
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def ask_greedy(client, messages, **kw):
    """A chat completion at temperature 0 on the default model with the ``openai`` client ``client``."""
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)
