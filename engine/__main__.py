"""``python -m engine ...`` is the ``engine`` command."""
import sys

from .cli import main

sys.exit(main())
