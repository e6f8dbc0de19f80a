"""Profile, simulate, plan: how many prefill and decode workers a workload needs.

- ``profile``: what one forward pass, a KV handoff and the serving path cost (JSON).
- ``measure`` / ``profile_cli``: ``pdserve profile`` measures one on this machine and writes it.
- ``sim_engine`` / ``sim_worker`` / ``simulator``: a discrete-event model of the router and
  both pools that runs pdserve's own scheduler, block manager and routing policies;
  ``sim_topology``: what it is asked (workers, settings) and what it answers.
- ``planner``: searches prefill/decode counts (and parallel degrees) for goodput per device.
- ``chunking``: sizes prefill chunks so a mixed step stays within the TPOT SLO.
- ``online``: the router's planner loop and its autoscaling gauges.
"""
