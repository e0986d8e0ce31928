"""Developer tools: before/after timings, soak runs, multi-worker and sampler benchmarks."""
