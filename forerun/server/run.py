"""Running the app: uvicorn on a socket of our own, the URL printed once it
accepts connections, and a clean stop on SIGINT/SIGTERM.

On the first signal the server stops listening, cancels the generation in
flight (it ends within one decoding round; a streamed client gets an error
event after the text generated so far, a waiting one a 503) and the queued
requests, then exits once the open responses are closed.  A second SIGINT
exits at once.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import uvicorn

from forerun.server.app import Service, create_app


class _Server(uvicorn.Server):
    """uvicorn's server, telling the worker about a signal and us about the
    moment it listens."""

    def __init__(self, config: uvicorn.Config, service: Service,
                 on_listening: Callable[[], None]) -> None:
        super().__init__(config)
        self._service = service
        self._on_listening = on_listening

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            self._on_listening()

    def handle_exit(self, sig, frame) -> None:
        self._service.worker.shutdown()
        super().handle_exit(sig, frame)


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (``port`` 0: any free
    port; read it back with ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(service: Service, sock: socket.socket, *, on_listening: Callable[[], None],
          log_level: str = "warning") -> None:
    """Serve until a signal stops the server."""
    config = uvicorn.Config(create_app(service), log_level=log_level, access_log=False,
                            lifespan="on", timeout_graceful_shutdown=30)
    _Server(config, service, on_listening).run(sockets=[sock])
