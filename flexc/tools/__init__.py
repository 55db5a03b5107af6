"""Tools around the library: the flexc command and pictures of masks and score_mods."""
