import sys

from bench.bench import main

sys.exit(main())
