"""Benchmarks: offline engine throughput against the memory-bandwidth floor, and a serving load generator.

`jaxserve bench offline`, `jaxserve bench serve` and `jaxserve bench compare` are the entry points
(`bench/cli.py`); `bench/peers/` starts the systems jaxserve is compared with.
"""
