import sys

from pypto_serving.app.cli import main

sys.exit(main())
