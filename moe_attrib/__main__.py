import sys

from moe_attrib.cli import main

sys.exit(main())
