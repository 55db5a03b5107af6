"""The traced mod and its readers: the IR, the tracer and its cache, lowering, evaluation, derivatives."""
