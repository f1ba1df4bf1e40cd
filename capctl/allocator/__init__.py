"""Convex allocation of a power budget across GPUs (pure functions: state in, caps out)."""
