"""`python -m moe_attrib`: the `moe-attrib` command."""

import sys

from moe_attrib.cli import main

sys.exit(main())
