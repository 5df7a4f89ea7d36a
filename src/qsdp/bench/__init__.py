"""Benchmarks: ``qsdp bench volume`` (bits per element on the wire, from the byte meter)."""
