"""``python -m flexc``: the ``flexc`` command."""
import sys

from .tools.cli import main

sys.exit(main())
