"""The demo training job and the small GPT model and local text data it (and the benchmarks) use."""
