import sys

from manager.main import main

sys.exit(main())
