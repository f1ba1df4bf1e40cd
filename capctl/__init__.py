"""capctl: a power-capping coordinator for GPU clusters run by Slurm.

Units: watts and degrees Celsius everywhere; milliwatts only at the NVML edge
(:mod:`nodeagent.nvml`).
"""

__version__ = "0.2.0"
