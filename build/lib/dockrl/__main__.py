import sys

from dockrl.cli import main

sys.exit(main())
