"""Benchmarks that check before they time (``numbarl-bench``); results go to docs/BENCHMARKS.md."""
