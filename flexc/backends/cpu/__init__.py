"""The CPU backend: block-sparse row loops, fused chunks, decoding, and their worker threads."""
