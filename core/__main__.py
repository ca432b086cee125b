import sys

from resmlp.core.cli import main

sys.exit(main())
