"""Kubernetes' side of "Jobs from Kubernetes", for tests: a kubelet's PodResources server
(real gRPC on a unix socket, its messages from the vendored api.proto) and a fake of the API
server's pod list (plain HTTP on loopback; a fake of a third-party service: what it answers
is Kubernetes' documented PartialObjectMetadataList, and it checks what the agent asks)."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc

from powerd.agent.podresources import api_pb2

# (namespace, pod, {resource name: device ids})
Pod = tuple[str, str, Mapping[str, list[str]]]


class FakeKubelet:
    """`v1.PodResourcesLister/List` on a unix socket, answering with `pods` as they are at
    each call; `fail` makes it answer UNAVAILABLE."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.pods: list[Pod] = []
        self.fail = False
        self.calls = 0
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2))
        handler = grpc.method_handlers_generic_handler(
            "v1.PodResourcesLister",
            {
                "List": grpc.unary_unary_rpc_method_handler(
                    self._list,
                    request_deserializer=api_pb2.ListPodResourcesRequest.FromString,
                    response_serializer=api_pb2.ListPodResourcesResponse.SerializeToString,
                )
            },
        )
        self._server.add_generic_rpc_handlers((handler,))
        self._server.add_insecure_port(f"unix://{socket}")

    def _list(self, request: Any, context: Any) -> Any:
        self.calls += 1
        if self.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet restarting")
        out = api_pb2.ListPodResourcesResponse()
        for namespace, name, resources in self.pods:
            pod = out.pod_resources.add(namespace=namespace, name=name)
            container = pod.containers.add(name="main")
            for resource, ids in resources.items():
                container.devices.add(resource_name=resource, device_ids=ids)
        return out

    def start(self) -> FakeKubelet:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None).wait(5)


@contextmanager
def short_dir() -> Iterator[Path]:
    """A directory with a short path: a unix socket's path has at most 107 bytes, and
    pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="kube", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def kubelet(socket: Path) -> Iterator[FakeKubelet]:
    server = FakeKubelet(socket).start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class FakeApiServer:
    """GET /api/v1/pods?fieldSelector=spec.nodeName=<node>: the pods of `labels` on that
    node (node → (namespace, pod) → labels), metadata only when asked. Records each request;
    answers `status` instead when set, or `body` as it is."""

    labels: dict[str, dict[tuple[str, str], dict[str, str]]] = field(default_factory=dict)
    token: str | None = None  # the bearer token required (None: none)
    status: int | None = None
    body: bytes | None = None
    requests: list[dict[str, str]] = field(default_factory=list)

    def answer(self, path: str, headers: Mapping[str, str]) -> tuple[int, bytes]:
        url = urllib.parse.urlsplit(path)
        query = urllib.parse.parse_qs(url.query)
        self.requests.append({"path": url.path, **{k.lower(): v for k, v in headers.items()}})
        if self.token is not None and headers.get("Authorization") != f"Bearer {self.token}":
            return 401, b'{"kind":"Status","code":401}'
        if self.status is not None:
            return self.status, b'{"kind":"Status"}'
        if self.body is not None:
            return 200, self.body
        selector = query.get("fieldSelector", [""])[0]
        if url.path != "/api/v1/pods" or not selector.startswith("spec.nodeName="):
            return 400, b'{"kind":"Status","code":400}'
        node = selector.removeprefix("spec.nodeName=")
        metadata_only = "as=PartialObjectMetadataList" in headers.get("Accept", "")
        items = []
        for (namespace, name), labels in self.labels.get(node, {}).items():
            meta = {"name": name, "namespace": namespace, "labels": labels}
            items.append(
                {"metadata": meta}
                if metadata_only
                else {"metadata": meta, "spec": {"nodeName": node}, "status": {}}
            )
        kind = "PartialObjectMetadataList" if metadata_only else "PodList"
        return 200, json.dumps({"kind": kind, "apiVersion": "v1", "items": items}).encode()


@contextmanager
def api_server(fake: FakeApiServer) -> Iterator[str]:
    """Serve `fake` on 127.0.0.1; yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = fake.answer(self.path, dict(self.headers.items()))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
