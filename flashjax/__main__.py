"""``python -m flashjax``: the same as the ``flashjax`` console script."""

import sys

from flashjax.cli import main

sys.exit(main())
