"""Synthetic engines for tests, the demo and benchmarks: real processes, real sockets,
real NIXL; only the model is fake (its KV blocks hold a deterministic byte pattern)."""
