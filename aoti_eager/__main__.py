import sys

from aoti_eager.cli import main

sys.exit(main())
