import sys

from cloudml_lib.cli import main

sys.exit(main())
