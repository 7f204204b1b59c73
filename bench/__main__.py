"""`python -m bench`: the benchmark (bench/benchmark.py says what it measures)."""

from bench.benchmark import main

main()
