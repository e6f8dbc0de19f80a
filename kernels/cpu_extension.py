"""Builds (once, cached) and loads the C++ CPU kernels (paged attention, quantized linears, fused ops).

The kernels are compiled on first use with the machine's own instruction set; the build lives
in torch's extension cache under a name that includes the sources, the torch version and the
CPU's feature flags, so a cache shared between different machines never loads a foreign build.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE_DIR = Path(__file__).parent / "csrc"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cpp"))


@functools.cache
def load():
    """The compiled module, or None when it cannot be built here (then torch fallbacks are used)."""
    try:
        from torch.utils import cpp_extension

        digest = hashlib.sha256()
        for path in [*_sources(), *sorted(SOURCE_DIR.glob("*.h"))]:
            digest.update(path.name.encode() + path.read_bytes())
        digest.update(torch.__version__.encode() + _cpu_flags().encode())
        return cpp_extension.load(
            name=f"pdserve_cpu_kernels_{digest.hexdigest()[:12]}",
            sources=[str(p) for p in _sources()],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any build problem means: use the torch fallbacks
        log.warning("C++ CPU kernels unavailable (%s); using torch fallbacks", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
