"""``python -m adaptdl.cli``."""

import sys

from adaptdl.cli import main

sys.exit(main())
