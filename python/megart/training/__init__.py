"""Training: data, learning-rate schedule, FLOPs accounting, data-parallel gradient sync."""
