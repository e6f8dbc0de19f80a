"""Fitting the step cost model to measured steps.

Least squares on relative error (a 20 ms decode step and a 2 s prefill weigh alike), with
every coefficient >= 0: with five terms, trying each subset of terms and keeping the best
non-negative solution is an exact non-negative least squares, in a few lines.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from pdserve.planner.profile import StepCost, StepShape


@dataclass(frozen=True, slots=True)
class StepSample:
    degree: int
    shape: StepShape
    ms: float  # measured (a median of repeats)
    label: str = ""

    def to_dict(self) -> dict:
        s = self.shape
        return {
            "degree": self.degree,
            "decodes": s.decodes,
            "decode_context": s.decode_context,
            "prefill_tokens": s.prefill_tokens,
            "prefill_pairs": s.prefill_pairs,
            "ms": self.ms,
            "label": self.label,
        }


def fit_step_cost(samples: list[StepSample]) -> tuple[StepCost, float]:
    """The non-negative cost that best fits ``samples`` (relative error); returns it and the
    median relative error of the fit over the samples."""
    if len(samples) < 2:
        raise ValueError(f"need at least 2 measured steps to fit a cost, got {len(samples)}")
    x = np.array([s.shape.features() for s in samples], dtype=float)
    y = np.array([s.ms for s in samples], dtype=float)
    if np.any(y <= 0):
        raise ValueError("measured step times must be > 0")
    xw, yw = x / y[:, None], np.ones_like(y)  # relative error: divide each row by its own time
    num_terms = x.shape[1]
    best, best_err = np.zeros(num_terms), np.inf
    for size in range(1, num_terms + 1):
        for subset in itertools.combinations(range(num_terms), size):
            cols = list(subset)
            coef, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(num_terms)
            full[cols] = coef
            err = float(np.sum((xw @ full - yw) ** 2))
            if err < best_err - 1e-12:
                best, best_err = full, err
    cost = StepCost(*(float(c) for c in best))
    predicted = np.array([cost.ms(s.shape) for s in samples])
    return cost, float(np.median(np.abs(predicted - y) / y))


def robust_fit(samples: list[StepSample], max_dropped: float = 0.2) -> tuple[StepCost, float, list[StepSample]]:
    """``fit_step_cost`` that sets aside samples a shared machine's other tenants disturbed: one
    at a time, the worst-fitting sample while it is off by more than 30% and by more than three
    times the median error, at most ``max_dropped`` of them. Returns the cost, its median
    relative error over the kept samples, and the samples set aside."""
    kept, dropped = list(samples), []
    while True:
        cost, error = fit_step_cost(kept)
        errors = [abs(cost.ms(s.shape) - s.ms) / s.ms for s in kept]
        worst = max(range(len(kept)), key=errors.__getitem__)
        if errors[worst] <= max(0.3, 3 * error) or len(dropped) + 1 > max_dropped * len(samples) or len(kept) <= 6:
            return cost, error, dropped
        dropped.append(kept.pop(worst))
