"""Tensor parallelism: the process group, sharded layers, checkpoint slices, spawned workers (docs/parallelism.md)."""
