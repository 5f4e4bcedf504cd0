"""`python -m moe_attrib`: the `moe-attrib` command."""

import sys

from moe_attrib.app.cli import main

sys.exit(main())
