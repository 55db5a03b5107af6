"""Shared pytest setup: make helper modules in tests/ (e.g. ``catalogue``) and the flexc package
importable, whether or not flexc is installed into the environment."""
import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
for path in (_TESTS, os.path.dirname(_TESTS)):
    if path not in sys.path:
        sys.path.insert(0, path)
