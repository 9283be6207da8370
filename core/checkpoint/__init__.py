"""Checkpoint reading: a run's checkpoints found, checked whole and plain data, and read into a model."""
