"""Shared code of the benchmarks in bench/ (see bench/README.md)."""
