"""Builds (once, cached) and loads the C++ CPU kernels (paged attention, quantized linears, fused ops).

The kernels are compiled with the machine's own instruction set, under a name that includes
the sources, the torch version and the CPU's feature flags, so a cache shared between
different machines never loads a foreign build, and the source and torch folders, so two
checkouts never rebuild each other's build. `make kernels` (and so `make test`) builds them
(`python -m pdserve.kernels.cpu_extension`), as `make demo` does where a compiler is missing
only with a warning; otherwise the first process that needs them does.

torch's builder guards a build with a lock file that a killed build leaves behind, after which
every later load waits on it forever. So builds are serialized by an flock of our own, which the
kernel releases when its holder dies; whoever holds it may clear torch's stale lock file.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import re
import stat
import sys
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE_DIR = Path(__file__).parent / "csrc"
CACHE_ENV = "PDSERVE_KERNEL_CACHE"  # where builds live; default ~/.cache/pdserve/kernels


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cpp"))


def module_name() -> str:
    digest = hashlib.sha256()
    for path in [*_sources(), *sorted(SOURCE_DIR.glob("*.h"))]:
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(torch.__version__.encode() + cpu_flags().encode())
    # ninja rebuilds when a command line changes, and those name the source and torch folders.
    digest.update(str(SOURCE_DIR.resolve()).encode() + str(Path(torch.__file__).parent).encode())
    return f"pdserve_cpu_kernels_{digest.hexdigest()[:12]}"


def cache_root() -> Path:
    """The first writable of $PDSERVE_KERNEL_CACHE, ~/.cache/pdserve/kernels and a temp folder
    (this user's own, 0700: a folder another user made there could swap the library we load)."""
    for candidate in (os.environ.get(CACHE_ENV), "~/.cache/pdserve/kernels"):
        if not candidate:
            continue
        try:
            candidate = Path(candidate).expanduser()
            candidate.mkdir(parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return Path(candidate)
        except (OSError, RuntimeError):  # RuntimeError: no home folder to expand "~" to
            continue
    shared = Path(tempfile.gettempdir()) / f"pdserve-kernels-{os.getuid()}"
    try:
        shared.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise OSError(f"no writable folder for the C++ kernel build ({e})") from None
    found = os.lstat(shared)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o022:
        raise OSError(f"{shared} is not this user's own private folder: not building the C++ kernels there")
    return shared


def _build(name: str, build_dir: Path):
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    flock = os.open(build_dir.parent / f"{name}.flock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(flock, "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released by the kernel if this process dies
        (build_dir / "lock").unlink(missing_ok=True)  # only a dead build can have left it
        if not (build_dir / f"{name}.so").exists():
            log.info("building the C++ CPU kernels in %s (once per machine and torch; takes minutes)", build_dir)
        return cpp_extension.load(
            name=name,
            sources=[str(p) for p in _sources()],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )


@functools.cache
def load():
    """The compiled module, or None when it cannot be built here (then torch fallbacks are used)."""
    try:
        name = module_name()
        return _build(name, cache_root() / name)
    except Exception as e:  # noqa: BLE001 - any build problem means: use the torch fallbacks
        log.warning("C++ CPU kernels unavailable (%s); using torch fallbacks", _why(e))
        return None


def _why(error: Exception) -> str:
    """A failed build's cause: its error lines (the first line of a ninja failure is a command)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    causes = [line for line in lines if re.search(r"\berror:|^FAILED:|No space left", line, re.IGNORECASE)]
    return " | ".join(causes[:4]) or (lines[0] if lines else type(error).__name__)


def main(argv: list[str] | None = None) -> int:
    """``--optional``: a build that fails here is a warning (pdserve runs on its torch
    fallbacks), not an error; what ``make demo`` wants, where ``make test`` wants the kernels."""
    optional = "--optional" in (sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # "building ... takes minutes" is shown
    start = time.perf_counter()
    module = load()
    if module is None:
        print("C++ CPU kernels could not be built here; pdserve will use its torch fallbacks", file=sys.stderr)
        return 0 if optional else 1
    print(f"C++ CPU kernels ready: {module.__file__} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
