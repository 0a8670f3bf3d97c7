"""What a result was measured on: the machine, the versions, and its memory bandwidth."""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import os
import platform
import time
from dataclasses import asdict, dataclass

import numpy as np

_PACKAGES = ("jaxserve", "jax", "jaxlib", "numpy", "httpx", "torch", "transformers", "vllm")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else `platform.processor()`."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    """Host, CPU, cores usable by this process, memory, and the versions of the packages that matter."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "memory_bytes": mem,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "threads_env": {k: v for k, v in os.environ.items()
                        if k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "XLA_FLAGS", "JAX_PLATFORMS")},
        "versions": versions,
    }


@dataclass(frozen=True)
class Bandwidth:
    """Memory bandwidth in bytes/s, best of several repeats over a buffer much larger than the caches."""

    read_1thread: float
    read_all_threads: float
    copy_1thread: float  # counts the bytes read plus the bytes written
    threads: int
    buffer_bytes: int
    memory: str = "host"  # "host" (numpy threads), or the accelerator whose memory was measured ("gpu")

    @property
    def best(self) -> float:
        """The most bytes/s moved by any of the measurements: the rate a floor is computed with.

        A floor must not be too high, so the highest rate wins, the copy's read-plus-write traffic included.
        """
        return max(self.read_1thread, self.read_all_threads, self.copy_1thread)

    def to_dict(self) -> dict:
        return {**asdict(self), "best": self.best}


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_device_bandwidth(buffer_bytes: int = 1 << 30, repeats: int = 5) -> Bandwidth:
    """Read (a max over the buffer) and copy (read + write of a new buffer) rates of the default JAX
    device's memory, for an engine whose weights and KV cache live there (a GPU's HBM)."""
    import jax
    import jax.numpy as jnp

    src = jnp.ones((buffer_bytes // 4,), jnp.float32)  # [n]
    read = jax.jit(jnp.max)
    copy = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready((read(src), copy(src)))
    read_rate = src.nbytes / _best(lambda: jax.block_until_ready(read(src)), repeats)
    copy_rate = 2 * src.nbytes / _best(lambda: jax.block_until_ready(copy(src)), repeats)
    return Bandwidth(read_rate, read_rate, copy_rate, 1, int(src.nbytes), memory=jax.default_backend())


def measure_bandwidth(buffer_bytes: int = 512 << 20, repeats: int = 5, threads: int | None = None) -> Bandwidth:
    """Read (a float32 max, vectorized and memory bound) and copy (`np.copyto`) rates with numpy, on one thread and on `threads`."""
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = buffer_bytes // 4
    src = np.ones(n, np.float32)  # [n]; touched so the pages exist before timing
    dst = np.empty_like(src)
    np.copyto(dst, src)
    nbytes = src.nbytes
    read1 = nbytes / _best(lambda: np.maximum.reduce(src), repeats)
    copy1 = 2 * nbytes / _best(lambda: np.copyto(dst, src), repeats)
    chunks = np.array_split(src, threads)
    # numpy releases the GIL inside the reduction, so threads read their chunks in parallel.
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        def read_all() -> None:
            list(pool.map(np.maximum.reduce, chunks))

        read_n = nbytes / _best(read_all, repeats)
    return Bandwidth(read1, read_n, copy1, threads, nbytes)
