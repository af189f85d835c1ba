"""``kvchat serve``: the OpenAI-compatible server (:mod:`kvchat.server`) on uvicorn.

Everything is checked before the model loads (a non-loopback ``--host``
needs an API key; a port that is not a port; a port in use: the socket listens
before the load, so a taken port is one ``kvchat: error:`` line in a second, not
after a minute's load, and no other server can take the port meanwhile). A
client that connects during the load waits in the socket's backlog until the
model is ready; the socket is then handed to uvicorn, and the "serving" line
comes.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys

from kvchat import settings

GRACEFUL_S = 5  # at SIGINT/SIGTERM, open streams get this long before they are cancelled (their turns stored)


def is_loopback(host: str) -> bool:
    """``host`` only reaches this machine (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvchat serve`` (``--model --kv-dtype --threads`` come from the shared model args)."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need --api-key)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on every /v1 request "
                   "(default: KVCHAT_API_KEY, which, unlike this flag, other users cannot see in the process list)")
    p.add_argument("--no-store", action="store_true", help="do not store API conversations as chats (nor their KV)")
    p.add_argument("--queue-timeout", type=float, default=30.0, metavar="S",
                   help="a request waiting this long for KV pool space gets 503 with Retry-After (default 30)")
    p.add_argument("--verbose", action="store_true", help="log requests, with their last user message")


def serve_api_key(args: argparse.Namespace) -> str | None:
    """The key clients must send: ``--api-key``, else ``KVCHAT_API_KEY``, else None (no key)."""
    return args.api_key or settings.api_key()


def cmd_serve(args: argparse.Namespace) -> int:
    """``kvchat serve``: validate, load the model, serve until SIGINT/SIGTERM (then flush snapshot writes).

    Raises:
        ValueError: a non-loopback host without an API key, a bad port or queue timeout, a port in use.
    """
    api_key = serve_api_key(args)
    if api_key is not None and not api_key.strip():
        raise ValueError("the API key (--api-key or KVCHAT_API_KEY) is blank; give a real key or none")
    if not is_loopback(args.host) and not api_key:
        raise ValueError(f"--host {args.host} is reachable from other machines: set KVCHAT_API_KEY or pass "
                         "--api-key KEY too (clients send it as 'Authorization: Bearer KEY')")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if not args.queue_timeout > 0:
        raise ValueError(f"--queue-timeout must be > 0 seconds, got {args.queue_timeout}")
    from kvchat.index import get_db

    sock = bind(args.host, args.port)  # before the data dir is touched: a taken port leaves nothing behind
    try:
        get_db()  # a damaged or newer database is one line now, as for every other command, not a 500 per request
        return _load_and_serve(args, api_key, sock)
    finally:
        sock.close()


def _load_and_serve(args: argparse.Namespace, api_key: str | None, sock: socket.socket) -> int:
    """Load the model, then serve on ``sock`` (listening, from :func:`bind`) until SIGINT/SIGTERM."""
    from kvchat.cpu_threads import checked_threads, on_own_thread
    from kvchat.progress import print_start_progress
    from kvchat.runtime import load_runtime, set_threads

    set_threads(checked_threads(args.threads))
    # the scheduler thread runs it (see on_own_thread); each request gets its own dense copy: none preallocated
    rt = on_own_thread(load_runtime, args.model, args.kv_dtype, preallocate=False, progress=print_start_progress)
    import uvicorn

    from kvchat.server.app import create_app
    from kvchat.server.scheduler import Scheduler

    made: list[Scheduler] = []

    def scheduler():
        made.append(Scheduler(rt, store=not args.no_store, queue_timeout_s=args.queue_timeout, verbose=args.verbose))
        return made[-1]

    app = create_app(scheduler, rt.info.name, api_key, args.host)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"kvchat: serving {rt.info.name} at http://{shown}:{args.port}/v1 "
          f"(KV {rt.engine.spec.kv_dtype}, context {rt.engine.max_context} tokens)", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning",
                            access_log=args.verbose, lifespan="on", timeout_graceful_shutdown=GRACEFUL_S)
    server = uvicorn.Server(config)
    uvicorn_exit = server.handle_exit

    def end_turns_then_exit(sig, frame) -> None:
        """At SIGINT/SIGTERM end the running turns first: each stream ends with an error event saying the
        answer was cut (the turn is stored as a cancelled one), so uvicorn's graceful shutdown has no stream
        left to cut."""
        for s in made:
            s.request_stop()
        uvicorn_exit(sig, frame)

    server.handle_exit = end_turns_then_exit  # uvicorn installs its signal handlers from this attribute
    server.run(sockets=[sock])
    return 0 if server.started else 2


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (IPv6 for an address with a colon), handed to uvicorn.

    Raises:
        ValueError: the address cannot be bound (port in use, address not on this machine, no permission).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host} port {port}: {exc.strerror or exc}") from None
