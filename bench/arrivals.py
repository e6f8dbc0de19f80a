"""Request arrival processes: when each request is sent, as offsets from the start of a run.

Gaps between requests are gamma distributed with shape ``burstiness`` and mean 1/rate, as in
vLLM's serving benchmark: burstiness 1 is a Poisson process (exponential gaps), < 1 is
burstier, > 1 more regular, and rate ``inf`` sends every request at once. Unlike vLLM the
offsets are not rescaled to end at exactly n/rate: they are the sampled process itself.
"""

from __future__ import annotations

import math

import numpy as np


def validate(rate: float, burstiness: float) -> None:
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isnan(burstiness) or burstiness <= 0 or math.isinf(burstiness):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds after the start for ``n`` requests; the first one goes at 0."""
    validate(rate, burstiness)
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def parse_rates(text: str) -> list[float]:
    """'1,2,4' or 'inf' -> rates; each must be > 0."""
    rates = []
    for part in text.split(","):
        part = part.strip()
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"request rate {part!r} is not a number (use e.g. 1,2,4 or inf)") from None
        validate(rate, 1.0)
        if rate in rates:  # its results would overwrite the first run's file
            raise ValueError(f"request rate {part!r} is given twice")
        rates.append(rate)
    if not rates:
        raise ValueError("give at least one request rate")
    return rates
