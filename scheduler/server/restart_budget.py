"""How often a dead scheduler process may be restarted: at most `max_restarts` starts in any `window_s` seconds,
each retry after a start that failed waiting a little longer (up to 5 s)."""

from __future__ import annotations

from collections import deque


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: deque[float] = deque()  # restarts within the window, oldest first

    def take(self, now: float) -> bool:
        """Count a restart at `now`; False (nothing counted) when the window already holds `max_restarts`."""
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    @property
    def backoff_s(self) -> float:
        """The wait before the next try after a failed start: longer the more restarts the window holds."""
        return min(0.5 * len(self._times), 5.0)
