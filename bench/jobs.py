"""Bench: what jobs cost the controller at fleet scale, outside the allocator.

A synthetic site (default 100,000 GPUs, 8 per node) with about 70 % of its GPUs in jobs of
8 to 4,096 GPUs (whole nodes, as the Slurm prolog puts multi-node jobs, plus a share of
single-node jobs by uuid). Measured, median of `--repeat` runs:

- compile: the tick's view of the jobs (`JobView.compile`: classes made for the jobs with
  a profile, the policy handed to the allocator), done when the jobs or the policy change;
- places: where each GPU sits (`GpuPlaces.build`), done when the set of GPUs changes;
- index: each GPU's job (`JobView.index`), done when the jobs or the set of GPUs change;
- per tick otherwise: the identity check and the class override (`np.where`);
- reported: the same jobs as the nodes would report them (Kubernetes, telemetry's `job`)
  coupled by `ReportedJobs.couple`, scope node and site, done when a report, the
  operators' jobs, the set of GPUs or a class changes;
- one job write on the event loop: `Overrides.put_job` (validation, conflict check, the
  new `Jobs`) and `opstate.capture` (the operators' state the ledger then writes to the
  state file and the database), and the size of that document.

    .venv/bin/python bench/jobs.py [--gpus 100000] [--share 0.7] [--max-size 4096] [--json]
    .venv/bin/python bench/jobs.py --max-size 8     # the most jobs: every one a node
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from powerd.controller.jobs import GpuPlaces, JobView, ReportedJobs
from powerd.controller.opstate import OperatorState, capture
from powerd.controller.overrides import Job, Jobs, Overrides
from powerd.testing.synthetic import make_policy
from powerd.topology import Topology


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    out, times = None, []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=100_000)
    ap.add_argument("--share", type=float, default=0.7, help="share of GPUs in jobs")
    ap.add_argument("--profiles", type=float, default=0.2, help="share of jobs with a profile")
    ap.add_argument("--max-size", type=int, default=4096, help="largest job, GPUs")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    gpus_per_node = 8
    nodes_total = args.gpus // gpus_per_node
    racks, nodes_per_rack = 32, 16
    rows = max(1, -(-nodes_total // (racks * nodes_per_rack)))
    policy = make_policy(rows, racks, nodes_per_rack, gpus_per_node)
    node_names = policy.node_names()[:nodes_total]
    uuids = [f"GPU-{i:07d}" for i in range(len(node_names) * gpus_per_node)]
    gpu_nodes = [n for n in node_names for _ in range(gpus_per_node)]
    rng = np.random.default_rng(args.seed)

    # Jobs of 8..4096 GPUs (log-uniform), whole nodes; a fifth of the 8-GPU ones by uuid.
    jobs: list[Job] = []
    at, target = 0, int(args.share * len(node_names))
    while at < target:
        size = int(2 ** rng.uniform(3, np.log2(max(args.max_size, 8)))) or 8
        count = min(size // gpus_per_node, target - at)
        nodes = tuple(node_names[at : at + count])
        by_uuid = count == 1 and rng.random() < 0.2
        profile = ((200.0, 0.3), (450.0, 0.9), (600.0, 1.0))
        jobs.append(
            Job(
                name=f"slurm-{len(jobs)}",
                class_="training",
                uuids=tuple(uuids[at * 8 : at * 8 + 8]) if by_uuid else (),
                nodes=() if by_uuid else nodes,
                profile=profile if rng.random() < args.profiles else None,
                reason="bench",
                actor="bench",
                created_at=0.0,
            )
        )
        at += count
    book, dropped = Jobs.build(jobs)
    assert not dropped

    compile_ms, view = timed(lambda: JobView.compile(policy, book), args.repeat)
    topology = Topology.build(policy, gpu_nodes)
    places_ms, places = timed(lambda: GpuPlaces.build(uuids, topology), args.repeat)
    index_ms, index = timed(lambda: view.index(places), args.repeat)
    in_jobs = int((index >= 0).sum())
    cls = np.zeros(len(uuids), dtype=np.int64)
    tick_ms, _ = timed(
        lambda: np.where(index >= 0, view.job_class[index], cls), max(args.repeat, 20)
    )

    names = view.names
    reported = [None if j < 0 else f"ml/{names[j]}" for j in index.tolist()]
    free = np.ones(len(uuids), dtype=np.bool_)

    def couple(scope: str) -> ReportedJobs:
        return ReportedJobs.couple(
            reported,
            free=free,
            class_index=cls,
            nodes=gpu_nodes,
            node_index=topology.gpu_groups[:, -1],
            scope=scope,
        )

    reported_node_ms, by_node = timed(lambda: couple("node"), args.repeat)
    reported_site_ms, by_site = timed(lambda: couple("site"), args.repeat)

    o = Overrides(jobs=book)
    spare = node_names[target : target + 2] or node_names[-2:]
    new = Job("bench-new", "training", (), tuple(spare), None, "bench", "bench", 0.0)

    def put() -> None:
        o.jobs = book
        o.put_job(policy, new, lambda _u: None, lambda _n: [])

    put_ms, _ = timed(put, args.repeat)
    capture_ms, state = timed(lambda: capture(o), args.repeat)
    doc_ms, doc = timed(lambda: OperatorState(revision=1, **state).model_dump_json(), args.repeat)
    out = {
        "gpus": len(uuids),
        "jobs": len(jobs),
        "gpus_in_jobs": in_jobs,
        "jobs_with_profile": sum(j.profile is not None for j in jobs),
        "compile_ms": round(compile_ms, 2),
        "places_ms": round(places_ms, 2),
        "index_ms": round(index_ms, 2),
        "per_tick_ms": round(tick_ms, 3),
        "reported_node_ms": round(reported_node_ms, 2),
        "reported_node_jobs": len(by_node.names),
        "reported_site_ms": round(reported_site_ms, 2),
        "reported_site_jobs": len(by_site.names),
        "put_job_ms": round(put_ms, 2),
        "capture_ms": round(capture_ms, 2),
        "state_json_ms": round(doc_ms, 2),
        "state_bytes": len(doc),
    }
    if args.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:>18}: {v}")


if __name__ == "__main__":
    main()
