# Benchmarks of the served pipeline (never run by the test suite): see perf/README.md.
