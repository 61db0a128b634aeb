"""Serving the admin API from the controller's event loop with uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import structlog
import uvicorn
from fastapi import FastAPI

from powerd.settings import ApiTls

log = structlog.get_logger(__name__)


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The controller owns SIGTERM/SIGINT/SIGHUP; uvicorn stops when told to, not on its own.
        yield


class ApiServer:
    """The API bound to `host:port` now (port 0: a free one), served by `serve(stop)`;
    over HTTPS with `tls` (then only HTTPS: a plain request on the port gets no answer).

    Binding in the constructor makes a taken port an OSError at start-up, before any task
    runs, instead of uvicorn's sys.exit from inside the event loop; TLS files that cannot
    be loaded are a ValueError that names them, at start-up too.
    """

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 8080,
        *,
        tls: ApiTls | None = None,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError:
            self._sock.close()
            raise
        self._sock.listen(128)
        self._sock.setblocking(False)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self.tls = tls
        config = uvicorn.Config(
            app,
            log_config=None,  # structlog owns logging; uvicorn's own lines go to stdlib
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            server_header=False,
            **({} if tls is None else _ssl_options(tls)),
        )
        try:
            config.load()  # here, not in serve(): the TLS files are read now
        except (OSError, ssl.SSLError) as exc:  # FileNotFoundError does not name the file
            self._sock.close()
            assert tls is not None
            raise ValueError(f"cannot load the API's TLS files ({_named(tls)}): {exc}") from None
        self._server = _EmbeddedServer(config)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'http' if self.tls is None else 'https'}://{host}:{self.port}"

    async def serve(self, stop: asyncio.Event) -> None:
        """Answer requests until `stop` is set, then finish the requests in flight."""

        async def stop_when_told() -> None:
            await stop.wait()
            self._server.should_exit = True

        watcher = asyncio.create_task(stop_when_told(), name="api-stop")
        log.info(
            "api_listening",
            url=self.url,
            client_certificates=self.tls is not None and self.tls.client_ca_file is not None,
        )
        try:
            await self._server.serve(sockets=[self._sock])
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            self._sock.close()
            log.info("api_stopped")


def _ssl_options(tls: ApiTls) -> dict[str, Any]:
    """uvicorn's TLS options: forward-secret AEAD ciphers only below TLS 1.3 (uvicorn's
    default, "TLSv1", lets in CBC and static-RSA suites), TLS 1.2 at least (Python's
    default), and with a client CA, a client certificate required."""
    return {
        "ssl_certfile": tls.cert_file,
        "ssl_keyfile": tls.key_file,
        "ssl_ciphers": "ECDHE+AESGCM:ECDHE+CHACHA20",
        "ssl_ca_certs": tls.client_ca_file,
        "ssl_cert_reqs": ssl.CERT_NONE if tls.client_ca_file is None else ssl.CERT_REQUIRED,
    }


def _named(tls: ApiTls) -> str:
    files = {
        "api_tls_cert_file": tls.cert_file,
        "api_tls_key_file": tls.key_file,
        "api_tls_client_ca_file": tls.client_ca_file,
    }
    return ", ".join(f"{k} {str(v)!r}" for k, v in files.items() if v is not None)


async def serve_api(
    app: FastAPI, host: str, port: int, stop: asyncio.Event, *, tls: ApiTls | None = None
) -> None:
    """Bind and serve until `stop` (see ApiServer to learn the port or fail early)."""
    await ApiServer(app, host, port, tls=tls).serve(stop)
