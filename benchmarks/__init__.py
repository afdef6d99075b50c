"""pdkv benchmarks."""
