"""``python -m lms``: the ``lms`` command."""

import sys

from lms.cli import main

sys.exit(main())
