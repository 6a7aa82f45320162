import sys

from pypto_serving.cli import main

sys.exit(main())
