"""Models only the tests and benchmarks use."""
