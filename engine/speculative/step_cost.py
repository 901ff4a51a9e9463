"""What a step costs as a function of its rows, learnt from the steps themselves: t(T) ~ a + b * T.

"auto" speculation weighs a draft's expected gain against the cost of its extra row: with B sequences sampling
in a step of T rows, the step yields B tokens in a + b * T seconds, so one more row pays off only if it yields
more than c = B * b / (a + b * T) tokens on average. Where a row costs little (a step bound by reading the
weights), c is small and drafts pay; where rows cost as much as the step (bound by arithmetic, or many rows)
c nears 1 and no draft does. The fit is a least-squares line over exponentially weighted sums of (rows,
seconds), so it follows the machine's load; it starts from two timed probe steps at load.
"""

from __future__ import annotations

DECAY = 0.98  # weight of the past at each observed step (an effective window of about 50 steps)
# A step this many times the fit's prediction was not slow but stopped (SIGSTOP, a VM or container pause): held out,
# for one such step would move a and b for hundreds of steps. MAX_SKIPPED + 1 of them in a row: the machine changed,
# and every one of them goes into the fit.
OUTLIER_RATIO = 10.0
MAX_SKIPPED = 8


class StepCostModel:
    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.fixed = 1.0  # a: seconds per step whatever its rows
        self.per_row = 1.0  # b: seconds per row (pessimistic until observed: no draft pays)
        self._is_fit = False  # a and b learnt from steps (before, a prediction means nothing)
        self._held: list[tuple[int, float]] = []  # the outliers in a row, not yet in the fit

    def observe(self, num_rows: int, seconds: float) -> None:
        if self._is_fit and seconds > OUTLIER_RATIO * (self.fixed + self.per_row * num_rows):
            if len(self._held) < MAX_SKIPPED:
                self._held.append((num_rows, seconds))
                return
            held, self._held = self._held, []
            for rows, held_seconds in held:
                self._add(rows, held_seconds)
        else:
            self._held = []  # a pause's step, and the machine is as it was
        self._add(num_rows, seconds)

    def _add(self, num_rows: int, seconds: float) -> None:
        d = DECAY
        self._w = self._w * d + 1
        self._x = self._x * d + num_rows
        self._y = self._y * d + seconds
        self._xx = self._xx * d + num_rows * num_rows
        self._xy = self._xy * d + num_rows * seconds
        spread = self._w * self._xx - self._x * self._x
        if spread > 1e-6 * self._w * self._w:  # rows varied enough to tell a from b
            b = (self._w * self._xy - self._x * self._y) / spread
            a = (self._y - b * self._x) / self._w
            self.per_row, self.fixed = max(b, 0.0), max(a, 0.0)
            self._is_fit = True

    def break_even(self, num_sampling: int, num_rows: int) -> float:
        """c: the tokens one more row must yield on average to pay for itself in a step like this one."""
        cost = self.fixed + self.per_row * num_rows
        return min(1.0, num_sampling * self.per_row / cost) if cost > 0 else 1.0
