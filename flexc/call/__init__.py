"""The public call: flex_attention, its validation, torch compatibility names, sinks and context parallelism."""
