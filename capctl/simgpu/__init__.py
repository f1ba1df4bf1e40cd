"""Simulated GPUs: control of the simulated NVML driver (``libnvidia-ml.so.1`` built from csrc/simnvml)."""
