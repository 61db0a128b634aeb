"""Slurm prolog and epilog for powerd jobs: a Slurm job's GPUs share one power cap.

    powerd_slurm.py prolog    register the job (PUT /api/v1/jobs/<prefix><SLURM_JOB_ID>)
    powerd_slurm.py epilog    delete it (DELETE /api/v1/jobs/<prefix><SLURM_JOB_ID>)

Run by prolog.sh / epilog.sh as slurmctld's PrologSlurmctld / EpilogSlurmctld: once per job,
on the controller host (docs/operations.md, "Jobs"). Python 3.8+ standard library only, so
the Slurm host needs no powerd install. It never fails the job: whatever goes wrong (powerd
down, a bad config, a conflict) is logged (stderr and syslog) and it exits 0; every call
has a short timeout.

Settings: KEY=VALUE lines in /etc/powerd/slurm.env (or the file $POWERD_SLURM_ENV names):
  POWERD_URL                admin API base URL; several, comma-separated, are tried in order
                            (a standby pair: the standby answers 409 and the next is tried)
  POWERD_TOKEN              an operator token
  POWERD_CLASS              the jobs' class (default: training)
  POWERD_PARTITION_CLASSES  per partition, e.g. `inference:inference,debug:batch`
  POWERD_JOB_PREFIX         prefix of the job names in powerd (default: slurm-)
  POWERD_TIMEOUT_S          per HTTP call and per scontrol call (default: 3)
  POWERD_SCONTROL           scontrol's path (default: found on PATH or in the usual places)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

DEFAULT_ENV = "/etc/powerd/slurm.env"
SEARCH_PATH = "/usr/bin:/bin:/usr/local/bin:/opt/slurm/bin:/usr/sbin"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
KEYS = (
    "POWERD_URL",
    "POWERD_TOKEN",
    "POWERD_CLASS",
    "POWERD_PARTITION_CLASSES",
    "POWERD_JOB_PREFIX",
    "POWERD_TIMEOUT_S",
    "POWERD_SCONTROL",
)


def log(message: str, *, error: bool = False) -> None:
    line = f"powerd-slurm: {message}"
    print(line, file=sys.stderr, flush=True)
    try:
        import syslog

        syslog.openlog("powerd-slurm", 0, syslog.LOG_DAEMON)
        syslog.syslog(syslog.LOG_WARNING if error else syslog.LOG_INFO, message)
    except Exception:  # no syslog here: stderr has it
        pass


def read_settings(path: str) -> dict[str, str]:
    """KEY=VALUE lines ('#' comments, optional quotes); unknown keys are ignored."""
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.strip()
            if not line or line.startswith("#") or "=" not in line:
                continue
            key, value = (part.strip() for part in line.split("=", 1))
            if key.startswith("export "):
                key = key[len("export ") :].strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            if key in KEYS:
                out[key] = value
    return out


class Api:
    def __init__(self, urls: list[str], token: str, timeout_s: float) -> None:
        self.urls = urls
        self.token = token
        self.timeout_s = timeout_s

    def call(self, method: str, path: str, body: object = None) -> tuple[int, dict]:
        """(status, JSON body) from the first controller that is up and not a standby;
        raises OSError when none answers."""
        last: Exception | None = None
        for base in self.urls:
            data = None if body is None else json.dumps(body).encode()
            req = urllib.request.Request(base.rstrip("/") + path, data=data, method=method)
            req.add_header("Authorization", f"Bearer {self.token}")
            if data is not None:
                req.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return resp.status, json.loads(resp.read() or b"{}")
            except urllib.error.HTTPError as exc:
                try:
                    answer = json.loads(exc.read() or b"{}")
                except ValueError:
                    answer = {"detail": f"HTTP {exc.code}"}
                if exc.code == 409 and "stands by" in str(answer.get("detail", "")):
                    last = OSError(f"{base}: {answer['detail']}")
                    continue  # a standby: the leader is another of the URLs
                return exc.code, answer
            except (OSError, ValueError) as exc:  # refused, timed out, not JSON
                last = exc
                log(f"{base}: {exc}", error=True)
        raise OSError(f"no powerd controller answered ({last})")


def scontrol_hostnames(nodelist: str, scontrol: str, timeout_s: float) -> list[str]:
    out = subprocess.run(
        [scontrol, "show", "hostnames", nodelist],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
    ).stdout
    return [h for h in out.split() if h]


def gpu_list(env: dict[str, str]) -> list[str]:
    """The job's GPUs as Slurm gives them: indices (or uuids) from SLURM_JOB_GPUS, else
    CUDA_VISIBLE_DEVICES."""
    for key in ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = env.get(key, "").strip()
        if value and value != "NoDevFiles":
            return [v.strip() for v in value.split(",") if v.strip()]
    return []


def job_gpus(api: Api, node: str, gpus: list[str]) -> tuple[list[str], list[str]]:
    """uuids of a node's GPUs by index (entries that are uuids already pass through), and
    the entries that could not be resolved (the node not heard yet)."""
    if all(not g.isdigit() for g in gpus):
        return gpus, []
    status, page = api.call("GET", f"/api/v1/gpus?node={urllib.parse.quote(node)}&limit=1000")
    by_index = {}
    if status == 200:
        by_index = {str(g["index"]): g["uuid"] for g in page.get("items", [])}
    else:
        log(f"cannot list the GPUs of {node}: HTTP {status} {page.get('detail', '')}", error=True)
    uuids, missing = [], []
    for g in gpus:
        if not g.isdigit():
            uuids.append(g)
        elif g in by_index:
            uuids.append(by_index[g])
        else:
            missing.append(g)
    return uuids, missing


def job_class(settings: dict[str, str], env: dict[str, str]) -> str:
    partition = env.get("SLURM_JOB_PARTITION", "")
    for pair in settings.get("POWERD_PARTITION_CLASSES", "").split(","):
        part, _, cls = pair.partition(":")
        if part.strip() and part.strip() == partition and cls.strip():
            return cls.strip()
    return settings.get("POWERD_CLASS") or "training"


def prolog(api: Api, name: str, settings: dict[str, str], env: dict[str, str]) -> None:
    timeout_s = api.timeout_s
    nodelist = env.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        log(f"job {name}: no SLURM_JOB_NODELIST; not registered", error=True)
        return
    scontrol = settings.get("POWERD_SCONTROL") or shutil.which(
        "scontrol", path=env.get("PATH") or SEARCH_PATH
    )
    if not scontrol:
        log(f"job {name}: scontrol not found (set POWERD_SCONTROL); not registered", error=True)
        return
    nodes = scontrol_hostnames(nodelist, scontrol, timeout_s)
    bad = [n for n in nodes if not HOST_RE.match(n)]
    if not nodes or bad:
        log(f"job {name}: node list {nodelist!r} gave {nodes[:5]!r}; not registered", error=True)
        return
    body: dict[str, object] = {"class": job_class(settings, env), "uuids": [], "nodes": []}
    gpus = gpu_list(env)
    if len(nodes) == 1 and gpus:
        # Part of one node: its GPUs by uuid, so other jobs on the node keep theirs.
        uuids, missing = job_gpus(api, nodes[0], gpus)
        if missing:
            log(f"job {name}: GPUs {','.join(missing)} of {nodes[0]} not known to powerd yet")
        if not uuids:
            log(f"job {name}: none of its GPUs is known to powerd; not registered", error=True)
            return
        body["uuids"] = uuids
    else:
        # Several nodes (or no GPU list): the job holds them whole.
        body["nodes"] = nodes
    user = env.get("SLURM_JOB_USER", "?")
    body["reason"] = f"slurm prolog: job {env.get('SLURM_JOB_ID')} of {user}"[:500]
    status, answer = api.call("PUT", f"/api/v1/jobs/{name}", body)
    if status == 200:
        job = answer.get("job", {})
        log(
            f"job {name} registered: class {job.get('class')}, {len(job.get('uuids', []))} "
            f"GPUs by uuid, nodes {','.join(job.get('nodes', [])) or '-'}, "
            f"{job.get('gpus_seen')} GPUs heard; durable {answer.get('durable')}"
        )
    else:
        log(f"job {name} not registered: HTTP {status} {answer.get('detail', '')}", error=True)


def epilog(api: Api, name: str, env: dict[str, str]) -> None:
    reason = urllib.parse.quote(f"slurm epilog: job {env.get('SLURM_JOB_ID')} ended")
    status, answer = api.call("DELETE", f"/api/v1/jobs/{name}?reason={reason}")
    if status == 200:
        log(f"job {name} deleted")
    elif status == 404:
        log(f"job {name} was not registered (nothing to delete)")
    else:
        log(f"job {name} not deleted: HTTP {status} {answer.get('detail', '')}", error=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in ("prolog", "epilog"):
        log("usage: powerd_slurm.py prolog|epilog", error=True)
        return 0
    env = dict(os.environ)
    path = env.get("POWERD_SLURM_ENV") or DEFAULT_ENV
    try:
        settings = read_settings(path)
        job_id = env.get("SLURM_JOB_ID", "")
        name = settings.get("POWERD_JOB_PREFIX", "slurm-") + job_id
        if not job_id or not NAME_RE.match(name):
            log(f"no usable SLURM_JOB_ID ({job_id!r}); nothing done", error=True)
            return 0
        urls = [u.strip() for u in settings.get("POWERD_URL", "").split(",") if u.strip()]
        if not urls or not settings.get("POWERD_TOKEN"):
            log(f"{path}: POWERD_URL and POWERD_TOKEN are needed; nothing done", error=True)
            return 0
        api = Api(urls, settings["POWERD_TOKEN"], float(settings.get("POWERD_TIMEOUT_S") or 3))
        if argv[1] == "prolog":
            prolog(api, name, settings, env)
        else:
            epilog(api, name, env)
    except Exception as exc:  # never fail the job
        log(f"{argv[1]} for job {env.get('SLURM_JOB_ID')!r} failed: {exc!r}", error=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
