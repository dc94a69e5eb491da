import sys

from batchmaker.manager.main import main

sys.exit(main())
