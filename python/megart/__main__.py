"""``python -m megart train ...``, so that ``torchrun -m megart train ...`` works."""

import sys

from megart.cli.main import main

sys.exit(main())
