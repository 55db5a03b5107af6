"""``python -m flexc``: the ``flexc`` command."""
import sys

from .cli import main

sys.exit(main())
