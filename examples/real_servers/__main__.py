import sys

from examples.real_servers._main import main

sys.exit(main())
