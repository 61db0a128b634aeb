"""Virtual time a test moves by hand."""

from __future__ import annotations

import asyncio


class SteppedClock:
    """Virtual time for code that sleeps: `sleep` waits until the test `advance`s past it.

    Unlike ManualClock (whose sleep moves time itself), several loops can sleep at once and
    the test decides when each period passes, while real I/O (the broker) runs freely.
    """

    def __init__(self, start: float = 1000.0, wall_offset: float = 1.7e9) -> None:
        self.now = start
        self.wall_offset = wall_offset
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + self.wall_offset

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.now + seconds, fut))
        await fut

    def advance(self, seconds: float) -> None:
        self.now += seconds
        due = [(d, f) for d, f in self._sleepers if d <= self.now + 1e-9]
        self._sleepers = [(d, f) for d, f in self._sleepers if d > self.now + 1e-9]
        for _, fut in due:
            if not fut.done():
                fut.set_result(None)
