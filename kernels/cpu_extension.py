"""Builds (once, cached) and loads the C++ CPU paged-attention kernel.

The kernel is compiled on first use with the machine's own instruction set; the build lives
in torch's extension cache under a name that includes the source, the torch version and the
CPU's feature flags, so a cache shared between different machines never loads a foreign build.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@functools.cache
def load():
    """The compiled module, or None when it cannot be built here (then the torch reference is used)."""
    try:
        from torch.utils import cpp_extension

        digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + _cpu_flags().encode()).hexdigest()[:12]
        return cpp_extension.load(
            name=f"pdserve_cpu_attention_{digest}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any build problem means: use the reference
        log.warning("C++ CPU attention kernel unavailable (%s); using the torch reference", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
