"""Small host-side trackers for "sustained" and "against its own history" decisions (plain numbers, checkpointed
as-is)."""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any


class RunningWindow:
    """The last ``size`` finite values of a statistic, with their median."""

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        if value == value and value not in (float("inf"), float("-inf")):
            self.values.append(float(value))

    def __len__(self) -> int:
        return len(self.values)

    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values), "size": self.values.maxlen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = deque(state.get("values", []), maxlen=state.get("size", self.values.maxlen))


class Streak:
    """Counts consecutive measurements for which a condition held, per key."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def update(self, key: str, condition: bool) -> int:
        self.counts[key] = self.counts.get(key, 0) + 1 if condition else 0
        return self.counts[key]

    def state_dict(self) -> dict[str, Any]:
        return dict(self.counts)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = {str(k): int(v) for k, v in state.items()}
