"""Kernel benchmarks, the calibration microbenchmarks and library probes (kernels/README.md); the device code
they measure is in :mod:`kernels`."""
