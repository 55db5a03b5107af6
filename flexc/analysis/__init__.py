"""Tile analysis: interval ranges, affine forms, row intervals, spans, index bounds, exact tile evaluation and block tables."""
