import sys

from codesign.engine.probe.entry import main

sys.exit(main(sys.argv[1:]))
