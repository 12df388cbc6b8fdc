"""Measurement helpers shared by the benchmarks and the CLI."""
