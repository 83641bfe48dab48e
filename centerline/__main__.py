import sys

from centerline.cli import main

sys.exit(main())
