import sys

from addnorm.cli import main

sys.exit(main())
