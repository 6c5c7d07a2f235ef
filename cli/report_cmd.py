"""`fsdpkit report`: pictures of a training run's metrics or of a benchmark (placeholder)."""
