import sys

from examples.real_vllm._main import main

sys.exit(main())
