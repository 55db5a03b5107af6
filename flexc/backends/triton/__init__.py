"""The Triton backend: generated forward, backward and decode kernels, their cache and launch."""
