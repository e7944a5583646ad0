"""``python -m hdp.trainer``: the ``hdp`` command line."""

import sys

from hdp.trainer.cli import main

sys.exit(main())
