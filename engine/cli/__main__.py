"""``python -m engine.cli ...`` is the ``engine`` command."""
import sys

from . import main

sys.exit(main())
