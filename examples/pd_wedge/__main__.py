import sys

from examples.pd_wedge import main

if __name__ == "__main__":
    sys.exit(main())
