"""A small HTTP client of the admin API (`Client`), for the CLI's commands
(powerd/cli/admin.py) and scripts: one method per endpoint, errors as `ApiError` with the
API's status and detail."""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8080"
V1 = "/api/v1"


def tls_context(
    ca_file: str | Path | None = None,
    cert_file: str | Path | None = None,
    key_file: str | Path | None = None,
) -> ssl.SSLContext:
    """What verifies the API's certificate (and presents ours): the host name is checked."""
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
        if cert_file is not None:
            ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:  # FileNotFoundError does not name the file
        files = {"CA": ca_file, "certificate": cert_file, "key": key_file}
        named = ", ".join(f"{k} {str(v)!r}" for k, v in files.items() if v is not None)
        raise ValueError(f"cannot load the TLS files ({named}): {exc}") from None
    return ctx


class ApiError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self.body = body
        super().__init__(f"HTTP {status}: {body.get('detail', body)}")


class Client:
    """The admin API at `url` (http:// or https://). Over HTTPS the server's certificate is
    checked against `ca_file` (the site's CA) or else the system's trust store; `cert_file`
    (with `key_file`, or the key in the same file) is this client's certificate, for an API
    that requires one (mutual TLS). ValueError names a TLS file that cannot be loaded."""

    def __init__(
        self,
        url: str,
        token: str | None,
        timeout_s: float = 10.0,
        *,
        ca_file: str | Path | None = None,
        cert_file: str | Path | None = None,
        key_file: str | Path | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        https = url.lower().startswith("https://")
        if not https and (ca_file or cert_file or key_file):
            # A CA given and silently unused would leave the server unchecked.
            raise ValueError(f"a CA or client certificate is for https:// URLs; not {url}")
        self.http = httpx.Client(
            base_url=url.rstrip("/"),
            headers=headers,
            timeout=timeout_s,
            verify=tls_context(ca_file, cert_file, key_file) if https else True,
        )

    def close(self) -> None:
        self.http.close()

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        r = self.http.request(method, path, **kwargs)
        if r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = {"detail": r.text[:500]}
            raise ApiError(r.status_code, body if isinstance(body, dict) else {"detail": body})
        return r.json()

    # reads
    def fleet(self) -> dict[str, Any]:
        return dict(self.call("GET", f"{V1}/fleet"))

    def overrides(self) -> dict[str, Any]:
        return dict(self.call("GET", f"{V1}/overrides"))

    def alarms(self) -> list[dict[str, Any]]:
        return list(self.call("GET", f"{V1}/alarms"))

    def why(self, uuid: str, at: float | None = None) -> dict[str, Any]:
        params = {} if at is None else {"at": datetime.fromtimestamp(at, tz=UTC).isoformat()}
        return dict(self.call("GET", f"{V1}/gpus/{uuid}/why", params=params))

    def pages(self, path: str, params: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """Every item of a paged list (`{"items", "total", ...}`), a thousand a request."""
        items: list[dict[str, Any]] = []
        while True:
            page = self.call(
                "GET", path, params={**(params or {}), "limit": 1000, "offset": len(items)}
            )
            items += page["items"]
            if not page["items"] or len(items) >= page["total"]:
                return items

    def gpus(self, **filters: str | None) -> list[dict[str, Any]]:
        """Every GPU the controller knows, in the fleet's order; filters as the endpoint's
        (`node`, `row`, `rack`, `class_`, `job`, `state`), None: not filtered."""
        params = {k.rstrip("_"): v for k, v in filters.items() if v is not None}
        return self.pages(f"{V1}/gpus", params)

    def groups(self, level: str | None = None) -> list[dict[str, Any]]:
        """Every budgeted group of the last tick, in the tree's order (a group before the
        groups under it), or those of one level."""
        return self.pages(f"{V1}/groups", {} if level is None else {"level": level})

    # writes
    def set_budget(
        self,
        group: str,
        budget_w: float,
        reason: str,
        *,
        ttl_s: float | None = None,
        expires_at: float | None = None,
    ) -> dict[str, Any]:
        body = {"budget_w": budget_w, "reason": reason, "ttl_s": ttl_s, "expires_at": expires_at}
        return dict(self.call("PUT", f"{V1}/budgets/{group}", json=body))

    def schedule_budget(
        self, group: str, budget_w: float, reason: str, *, start: float, end: float | None
    ) -> dict[str, Any]:
        body = {"budget_w": budget_w, "reason": reason, "start": start, "end": end}
        return dict(self.call("POST", f"{V1}/budgets/{group}/schedule", json=body))

    def schedules(self) -> list[dict[str, Any]]:
        return list(self.call("GET", f"{V1}/schedules"))

    def cancel_schedule(self, schedule_id: str, reason: str) -> dict[str, Any]:
        return dict(self.call("DELETE", f"{V1}/schedules/{schedule_id}", params={"reason": reason}))

    def clear_budget(self, group: str, reason: str) -> dict[str, Any]:
        return dict(self.call("DELETE", f"{V1}/budgets/{group}", params={"reason": reason}))

    def pin(self, uuid: str, watts: float, reason: str) -> dict[str, Any]:
        body = {"watts": watts, "reason": reason}
        return dict(self.call("PUT", f"{V1}/gpus/{uuid}/pin", json=body))

    def unpin(self, uuid: str, reason: str) -> dict[str, Any]:
        return dict(self.call("DELETE", f"{V1}/gpus/{uuid}/pin", params={"reason": reason}))

    def drain(self, node: str, reason: str) -> dict[str, Any]:
        return dict(self.call("PUT", f"{V1}/nodes/{node}/drain", json={"reason": reason}))

    def undrain(self, node: str, reason: str) -> dict[str, Any]:
        return dict(self.call("DELETE", f"{V1}/nodes/{node}/drain", params={"reason": reason}))

    def hand_over(self, to: Sequence[Mapping[str, str]], reason: str) -> dict[str, Any]:
        return dict(self.call("PUT", f"{V1}/handover", json={"to": list(to), "reason": reason}))

    def cancel_handover(self, reason: str) -> dict[str, Any]:
        return dict(self.call("DELETE", f"{V1}/handover", params={"reason": reason}))

    def assign_class(
        self, cls: str, reason: str, *, uuids: Sequence[str] = (), nodes: Sequence[str] = ()
    ) -> dict[str, Any]:
        body = {"class": cls, "uuids": list(uuids), "nodes": list(nodes), "reason": reason}
        return dict(self.call("POST", f"{V1}/classes/assign", json=body))

    def clear_class(
        self, reason: str, *, uuids: Sequence[str] = (), nodes: Sequence[str] = ()
    ) -> dict[str, Any]:
        body = {"uuids": list(uuids), "nodes": list(nodes), "reason": reason}
        return dict(self.call("POST", f"{V1}/classes/clear", json=body))

    def jobs(self) -> list[dict[str, Any]]:
        return self.pages(f"{V1}/jobs")

    def put_job(
        self,
        name: str,
        cls: str,
        reason: str,
        *,
        uuids: Sequence[str] = (),
        nodes: Sequence[str] = (),
        profile: list[list[float]] | None = None,
    ) -> dict[str, Any]:
        body = {
            "class": cls,
            "uuids": list(uuids),
            "nodes": list(nodes),
            "profile": profile,
            "reason": reason,
        }
        return dict(self.call("PUT", f"{V1}/jobs/{name}", json=body))

    def delete_job(self, name: str, reason: str) -> dict[str, Any]:
        return dict(self.call("DELETE", f"{V1}/jobs/{name}", params={"reason": reason}))


# ---- rendering ----
