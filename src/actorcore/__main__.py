import sys

from actorcore.cli import main

sys.exit(main())
