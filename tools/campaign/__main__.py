import sys

from campaign.call import main

sys.exit(main())
