"""What a profile and SLOs add to a router: conditional routing and the online planner."""

from __future__ import annotations

import logging
import statistics

from pdserve.planner.online import OnlinePlanner
from pdserve.planner.profile import Profile
from pdserve.planner.thresholds import conditional_config
from pdserve.router.conditional import DEFAULT_THRESHOLD_TOKENS, ConditionalConfig, ConditionalRouter
from pdserve.settings import RouterSettings

log = logging.getLogger(__name__)


def attach_planner(dispatcher, settings: RouterSettings, disaggregated: bool, model_dir: str) -> OnlinePlanner | None:
    """Sets ``dispatcher.conditional`` (with --conditional) and returns the online planner,
    already observing the dispatcher (with --profile and an SLO), for the caller to start.
    Raises ValueError/FileNotFoundError on a bad profile."""
    profile = Profile.load(settings.profile) if settings.profile else None
    if profile is not None:
        profile.warn_if_other_model(model_dir, settings.profile)
    if settings.conditional and not disaggregated:
        log.warning(
            "--conditional needs a prefill pool; with none, every prompt is prefilled by its decode worker anyway"
        )
    elif settings.conditional:
        if profile is not None:
            config = conditional_config(profile, settings.slo_tpot_ms, settings.conditional_threshold_tokens)
        else:
            threshold = settings.conditional_threshold_tokens
            config = ConditionalConfig(threshold_tokens=DEFAULT_THRESHOLD_TOKENS if threshold is None else threshold)
        dispatcher.conditional = ConditionalRouter(config)
        log.info(
            "conditional disaggregation: decode workers prefill up to %d uncached prompt tokens themselves "
            "(local %.0f tok/s, remote %.0f tok/s, handoff %.0f ms; 0 = as reported)",
            config.threshold_tokens,
            config.local_tokens_per_s,
            config.remote_tokens_per_s,
            config.handoff_ms,
        )
    if profile is None:
        return None
    if settings.slo_ttft_ms is None and settings.slo_tpot_ms is None:
        log.info("online planner off: it needs --slo-ttft-ms and/or --slo-tpot-ms besides --profile")
        return None

    def decode_batch() -> float:
        running = [w.last_stats.running for w in dispatcher.registry.decode if w.last_stats is not None]
        return statistics.fmean(running) if running else 1.0

    planner = OnlinePlanner(
        profile,
        settings.slo_ttft_ms,
        settings.slo_tpot_ms,
        window_s=settings.autoscale_window_s,
        interval_s=settings.autoscale_interval_s,
        decode_batch=decode_batch,
    )
    dispatcher.observer = planner
    log.info(
        "online planner: every %.0f s from the last %.0f s of arrivals, profile %s",
        settings.autoscale_interval_s,
        settings.autoscale_window_s,
        settings.profile,
    )
    return planner
