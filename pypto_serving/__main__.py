import sys

from pypto_serving.app.entry import main

sys.exit(main())
