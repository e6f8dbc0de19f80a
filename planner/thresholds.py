"""What a profile implies for conditional disaggregation (router.conditional).

On an idle prefill pool a prompt's first token takes, on the remote path, the prefill worker's
compute, the KV handoff and the extra hop; on the local path, the decode worker's chunks,
each as large as the TPOT SLO allows next to the decodes it runs. The threshold is the
longest uncached prompt for which the local path is no slower; the speeds let the router
weigh a backed-up pool against the local path at run time.
"""

from __future__ import annotations

import math

from pdserve.planner.chunking import sizer_for
from pdserve.planner.profile import Profile, StepShape
from pdserve.router.conditional import ConditionalConfig

TYPICAL_DECODES = 8  # the decode batch the threshold assumes the decode worker runs beside a prompt
TYPICAL_CONTEXT = 512
REFERENCE_PROMPT = 512  # prompt length at which prefill speeds are quoted
MAX_THRESHOLD = 8192


def local_prefill_ms(profile: Profile, tokens: int, degree: int, tpot_ms: float | None) -> float:
    """First token of a ``tokens``-token prompt prefilled on a decode worker that runs the
    typical batch: chunks sized for the TPOT SLO (one step each), or the whole prompt in one
    step without an SLO."""
    cost = profile.step_cost(degree)
    decodes, context = TYPICAL_DECODES, TYPICAL_DECODES * TYPICAL_CONTEXT
    if tpot_ms is None:
        return cost.ms(_shape(decodes, context, tokens))
    chunk = sizer_for(profile, degree, tpot_ms).tokens(decodes, context)
    full, rest = divmod(tokens, chunk)
    step = cost.ms(_shape(decodes, context, chunk)) + profile.overheads.step_ms
    return full * step + (cost.ms(_shape(decodes, context, rest)) + profile.overheads.step_ms if rest else 0.0)


def remote_prefill_ms(profile: Profile, tokens: int, degree: int) -> float:
    return (
        profile.step_cost(degree).prefill_alone_ms(tokens)
        + profile.overheads.step_ms
        + profile.transfer_ms(tokens)
        + profile.overheads.handoff_ms
    )


def break_even_tokens(profile: Profile, prefill_degree: int, decode_degree: int, tpot_ms: float | None) -> int:
    """The longest prompt (in steps of 16 tokens) whose local prefill is no slower than the remote one."""
    best = 0
    for tokens in range(16, MAX_THRESHOLD + 1, 16):
        if local_prefill_ms(profile, tokens, decode_degree, tpot_ms) > remote_prefill_ms(
            profile, tokens, prefill_degree
        ):
            break
        best = tokens
    return best


def conditional_config(
    profile: Profile,
    tpot_ms: float | None = None,
    threshold_tokens: int | None = None,
    prefill_degree: int | None = None,
    decode_degree: int | None = None,
) -> ConditionalConfig:
    """``threshold_tokens`` overrides the profile's break-even length; degrees default to the
    profile's smallest (what one worker of a local stack gets on a small machine)."""
    prefill_degree = prefill_degree or profile.degrees[0]
    decode_degree = decode_degree or profile.degrees[0]
    local_rate = REFERENCE_PROMPT / local_prefill_ms(profile, REFERENCE_PROMPT, decode_degree, tpot_ms) * 1e3
    remote_ms = profile.step_cost(prefill_degree).prefill_alone_ms(REFERENCE_PROMPT) + profile.overheads.step_ms
    threshold = (
        threshold_tokens
        if threshold_tokens is not None
        else break_even_tokens(profile, prefill_degree, decode_degree, tpot_ms)
    )
    return ConditionalConfig(
        threshold_tokens=threshold,
        local_tokens_per_s=local_rate if math.isfinite(local_rate) else 0.0,
        remote_tokens_per_s=REFERENCE_PROMPT / remote_ms * 1e3 if remote_ms > 0 else 0.0,
        handoff_ms=profile.overheads.handoff_ms + profile.transfer_ms(REFERENCE_PROMPT),
    )


def _shape(decodes: int, context: int, prefill_tokens: int) -> StepShape:
    return StepShape.of([context // max(1, decodes)] * decodes, [(0, prefill_tokens)] if prefill_tokens else [])
