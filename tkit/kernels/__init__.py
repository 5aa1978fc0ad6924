"""Triton kernels, one module per op family. Import the public functions from ``tkit``."""
