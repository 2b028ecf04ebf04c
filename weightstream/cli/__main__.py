"""``python -m weightstream.cli``: the ``weightstream`` command."""

import sys

from weightstream.cli import main

sys.exit(main())
