import sys

from batchmaker.worker.main import main

sys.exit(main())
