"""``python -m kvbridge.cli ...``: the ``kvbridge`` command without its script."""

import sys

from kvbridge.cli.main import main

sys.exit(main())
