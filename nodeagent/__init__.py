"""Node agent: the only code that touches GPU hardware (through NVML)."""
