import sys

from batchmaker.manager.loop.main import main

sys.exit(main())
