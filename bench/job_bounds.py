"""Bench: a controller with its jobs at their bounds, and what every later write costs.

Builds a controller (a small policy, no agents: the jobs' GPUs are unseen, which the API
accepts) with its ledger, a state file and a SQLite store, as `powerd controller` runs
them; puts `--jobs` jobs of `--uuids` GPUs each, named by uuid (real-looking uuids:
`GPU-` and 36 characters, as NVML gives them) through the path an API write takes
(`Ledger.commit`), then times `--writes` later operator writes (a temporary
budget set, again and again). Each job's reason is 500 characters, its bound. Prints the
state file's size, the store's size, the process's RSS after the jobs and after the
writes, and the median time of a later write.

    .venv/bin/python bench/job_bounds.py                      # the bounds in force
    .venv/bin/python bench/job_bounds.py --jobs 64 --uuids 16384 --json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from powerd.clock import SystemClock
from powerd.controller.build import build_controller
from powerd.controller.opstate import StateFile
from powerd.controller.overrides import MAX_JOB_GPUS, MAX_JOBS_UUIDS
from powerd.store import Store, upgrade
from powerd.testing.synthetic import make_policy
from powerd.transport import MemoryBroker


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def gpu_uuid(i: int) -> str:
    return f"GPU-{uuid.UUID(int=i * 0x9E3779B97F4A7C15 % (1 << 128))}"


async def run(
    jobs: int, per_job: int, writes: int, reason_chars: int, workdir: Path
) -> dict[str, Any]:
    policy = make_policy(1, 2, 2, 8)
    db_url = f"sqlite:///{workdir / 'powerd.db'}"
    await asyncio.to_thread(upgrade, db_url)
    store = Store(db_url)
    state_path = workdir / "powerd-state.json"
    controller = build_controller(
        policy,
        MemoryBroker().client("controller"),
        SystemClock(),
        store=store,
        state_file=StateFile(state_path),
    )
    ledger = controller.ledger
    cls = next(iter(policy.classes))
    stop = asyncio.Event()
    rss_start = rss_mib()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(ledger.run(stop), name="ledger")
        t0 = time.perf_counter()
        for j in range(jobs):
            uuids = [gpu_uuid(j * per_job + k) for k in range(per_job)]
            outcome = await ledger.commit(
                lambda j=j, uuids=uuids: controller.put_job(
                    f"slurm-{j}",
                    cls,
                    uuids=uuids,
                    nodes=[],
                    profile=None,
                    actor="bench",
                    reason="r" * reason_chars,
                ),
                lowers_power=False,
            )
            assert outcome.applied and outcome.durable, outcome
        fill_s = time.perf_counter() - t0
        await ledger.flush(30)
        gc.collect()
        rss_jobs = rss_mib()
        group = policy.groups[0]
        times, audited = [], 0
        for w in range(writes):
            t0 = time.perf_counter()
            outcome = await ledger.commit(
                lambda w=w: controller.set_budget(
                    group.name,
                    group.budget_w - 1 - w,
                    expires_at=None,
                    actor="bench",
                    reason="write",
                ),
                lowers_power=True,
            )
            times.append(time.perf_counter() - t0)
            assert outcome.applied, outcome
            audited += outcome.audited  # False: the database took longer than the API waits
        stop.set()
    gc.collect()
    store.close()
    return {
        "jobs": jobs,
        "uuids_per_job": per_job,
        "uuids": jobs * per_job,
        "fill_s": round(fill_s, 1),
        "state_file_bytes": await asyncio.to_thread(lambda: state_path.stat().st_size),
        "rss_start_mib": round(rss_start),
        "rss_with_jobs_mib": round(rss_jobs),
        "rss_after_writes_mib": round(rss_mib()),
        "write_ms_median": round(statistics.median(times) * 1000, 1),
        "write_ms_max": round(max(times) * 1000, 1),
        "writes_audited_in_time": audited,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--uuids", type=int, default=MAX_JOB_GPUS, help="GPUs per job, by uuid")
    ap.add_argument("--jobs", type=int, default=MAX_JOBS_UUIDS // MAX_JOB_GPUS)
    ap.add_argument("--writes", type=int, default=10, help="later writes timed")
    ap.add_argument("--reason", type=int, default=500, help="characters of each job's reason")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="powerd-bench-") as tmp:
        out = asyncio.run(run(args.jobs, args.uuids, args.writes, args.reason, Path(tmp)))
        out["db_bytes"] = sum(p.stat().st_size for p in Path(tmp).glob("powerd.db*"))
    if args.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:>22}: {v}")


if __name__ == "__main__":
    main()
