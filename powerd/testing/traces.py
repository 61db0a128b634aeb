"""Trace files as nvidia-smi writes them, made here: for tests and the shipped examples.

    python -m powerd.testing.traces policies/scenarios/traces   # the shipped examples

A real recording (docs/simulator.md, "Recorded traces") replaces them one for one.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

START = datetime(2026, 12, 3, 16, 0, 0, tzinfo=UTC)


def _training(n: int, dt: float, rng: np.random.Generator) -> np.ndarray:
    """Compute at 640-690 W; every ~5 minutes a 30 s checkpoint near 300 W (all in step)."""
    t = np.arange(n) * dt
    base = 665.0 + 20.0 * np.sin(2 * np.pi * t / 47.0)
    checkpoint = (t % 300.0) < 30.0
    return np.where(checkpoint, 300.0, base)[:, None] + rng.normal(0.0, 6.0, (n, 1))


def _inference(n: int, dt: float, rng: np.random.Generator) -> np.ndarray:
    """Load that wanders between 220 and 560 W, with short bursts."""
    steps = rng.normal(0.0, 12.0 * np.sqrt(dt), n)
    level = np.clip(390.0 + np.cumsum(steps), 220.0, 560.0)
    burst = rng.random(n) < 0.05
    return (level + np.where(burst, 120.0, 0.0))[:, None]


def write_trace(
    path: Path,
    *,
    kind: str = "training",
    gpus: int = 4,
    duration_s: float = 600.0,
    interval_s: float = 1.0,
    seed: int = 0,
    units: bool = True,
) -> Path:
    """`nvidia-smi --query-gpu=timestamp,index,uuid,power.draw,power.limit --format=csv`
    as it would have printed `gpus` GPUs of one node for `duration_s`."""
    rng = np.random.default_rng(seed)
    n = round(duration_s / interval_s)
    shape = _training if kind == "training" else _inference
    draw = np.clip(shape(n, interval_s, rng) + rng.normal(0.0, 4.0, (n, gpus)), 80.0, 700.0)
    w = " W" if units else ""
    lines = ["timestamp, index, uuid, power.draw [W], power.limit [W]"]
    for k in range(n):
        stamp = (START + timedelta(seconds=k * interval_s)).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        for g in range(gpus):
            uuid = f"GPU-{seed:04x}{g:04x}-0000-4000-8000-{kind[:4]}{g:08d}"
            lines.append(f"{stamp}, {g}, {uuid}, {draw[k, g]:.2f}{w}, 700.00{w}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "traces")
    write_trace(out / "training-node.csv", kind="training", seed=1, interval_s=2.0)
    write_trace(out / "inference-node.csv", kind="inference", seed=2, interval_s=2.0)
    print(f"wrote {out}/training-node.csv, {out}/inference-node.csv")


if __name__ == "__main__":
    main()
