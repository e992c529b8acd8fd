"""Triton kernels: the transport of the triton provider."""
