import sys

from codesign.cli import main

sys.exit(main())
