"""The tracer's parts: proxies, the torch operations on them, the routing of torch calls, the tracer
itself, and what a mod captures and where its lines are. :func:`flexc.mods.trace.trace` is the entry."""
