"""What one batch of curve refits costs: a fixed part per batch and a part per fit (s).

:meth:`coordinator.models.Models._refit_due` sizes each batch of curve refits
(:func:`capctl.allocator.batchfit.fit_curves`) to the interval's refit budget left. A batch's cost
is mostly fixed: on the 2-core test host one fit alone took 2-10 ms and five ~10 ms (7 Dec 2026,
bench/interval_cost.py at 8,000 GPUs, under the load of other work). A cost per fit alone (the
batch's time over its fits, the model before 7 Dec 2026) took the fixed part for a per-fit one:
after a batch of one the next batch was sized one, and the last batch of an interval always held
at least one fit, however little budget was left. The refit stage then ran 13-22 ms against its
12 ms budget at 8,000 GPUs while doing only 2-15 fits. Here the cost of ``n`` fits is
``fixed_s + each_s * n``, both fitted to the measured batches (a least-squares line over the
recent batches, exponentially weighted); a batch starts only when it fits in the budget left,
except the interval's first (at least one fit: every interval makes progress).

With a cost per fit and no fixed part (the what-if simulator's budget clock charges 1 ms per fit,
capctl/sim/policies.py), the line finds ``fixed_s`` ~0 once batch sizes vary, and sizes batches
as the model before did (a budget of 10 ms: ten fits).
"""

from __future__ import annotations

FIXED_PRIOR_S = 3e-3
"""First estimate of a batch's fixed cost (s): 4 ms for one fit alone, 0.5-1.3 ms per fit in
batches of 16-256 (tests/allocator/test_batchfit.py's instances, 2-core host, 4 Dec 2026)."""
EACH_PRIOR_S = 0.7e-3
"""First estimate of the cost of each fit of a batch (s; same measurements)."""
DECAY = 0.8
"""Weight of the batches measured before the latest one in the fitted line (per batch)."""
MIN_SIZE_VARIANCE = 0.25
"""Below this variance of the recent batch sizes (fits^2) the line is not fitted: the fixed part
is kept and the per-fit part follows the mean cost (batches of one size cannot tell them apart)."""
MIN_EACH_S = 1e-6
"""The least cost per fit taken (s): a line whose slope is not positive is measurement noise."""
MAX_COST_S = 1.0
"""The most either part is taken to be (s): a batch that took longer (a host paused) is capped."""


class RefitCost:
    """The fitted cost line of a batch of curve refits (see module docstring): :attr:`fixed_s` +
    :attr:`each_s` x fits, in seconds of the refit budget's clock."""

    __slots__ = ("fixed_s", "each_s", "_w", "_n", "_t", "_nn", "_nt")

    def __init__(self, fixed_s: float = FIXED_PRIOR_S, each_s: float = EACH_PRIOR_S) -> None:
        self.fixed_s = fixed_s
        self.each_s = each_s
        self._w = self._n = self._t = self._nn = self._nt = 0.0  # decayed sums: 1, n, t, n^2, n t

    def size(self, left_s: float, most: int, first: bool) -> int:
        """How many fits (0 to ``most``) the budget left ``left_s`` (s) pays for; at least one
        when ``first`` (the interval's first batch), else 0 when not even one fits."""
        n = int((left_s - self.fixed_s) / self.each_s) if left_s > self.fixed_s else 0
        n = min(most, n)
        return max(n, 1) if first else max(n, 0)

    def observe(self, fits: int, cost_s: float) -> None:
        """A batch of ``fits`` (>= 1) refits took ``cost_s`` seconds: the line is fitted again."""
        if fits < 1 or not cost_s == cost_s:  # (NaN: a clock that went wrong; nothing learned)
            return
        cost_s = min(max(cost_s, 0.0), MAX_COST_S * (1 + fits))
        d = DECAY
        self._w = self._w * d + 1.0
        self._n = self._n * d + fits
        self._t = self._t * d + cost_s
        self._nn = self._nn * d + fits * fits
        self._nt = self._nt * d + fits * cost_s
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n * mean_n
        if var > MIN_SIZE_VARIANCE:
            each = (self._nt / self._w - mean_n * mean_t) / var
        else:  # (one size: the fixed part kept, the per-fit part through the mean)
            each = (mean_t - self.fixed_s) / mean_n
        each = min(max(each, MIN_EACH_S), MAX_COST_S)
        self.fixed_s = min(max(mean_t - each * mean_n, 0.0), MAX_COST_S)  # (the line through the mean)
        self.each_s = each
