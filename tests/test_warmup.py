"""The warmup's compiles side by side (`jaxserve.engine.warmup`)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.warmup import compile_all, workers


def test_compiled_jobs_are_not_compiled_again_when_called():
    """Each job compiled in the pool (in threads other than the caller's) is found compiled by its call."""
    compiles, threads = [], set()

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        fns = [jax.jit(lambda x, k=k: jnp.sin(x) * k) for k in range(4)]

        def args(n):
            threads.add(threading.get_ident())
            return (np.ones(n, np.float32),)

        compile_all([(f, lambda n=n: args(n)) for n, f in zip((3, 5, 7, 9), fns, strict=True)])
        assert len(compiles) == 4 and threading.get_ident() not in threads
        for n, f in zip((3, 5, 7, 9), fns, strict=True):
            f(np.ones(n, np.float32)).block_until_ready()
        assert len(compiles) == 4  # none more
        fns[0](np.ones(11, np.float32)).block_until_ready()  # (a shape not compiled before does compile)
        assert len(compiles) == 5
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_a_failing_compile_is_raised():
    def bad():
        raise ValueError("no such bucket")

    with pytest.raises(ValueError, match="no such bucket"):
        compile_all([(jax.jit(jnp.sin), lambda: (np.ones(3),)), (jax.jit(jnp.cos), bad)])


def test_workers():
    assert workers(1) == 1 and workers(0) == 1
    assert 2 <= workers(100) and workers(3) <= 3
