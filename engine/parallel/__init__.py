"""Tensor and pipeline parallel workers: rank processes, their layouts, and the step channel
between the driver and its ranks."""
