import sys

if sys.argv[1:2] == ["faults"]:
    from examples.real_servers._faults import main as faults

    sys.exit(faults(sys.argv[2:]))
if sys.argv[1:2] == ["advice"]:
    from examples.real_servers._advice import main as advice

    sys.exit(advice(sys.argv[2:]))

from examples.real_servers._main import main

sys.exit(main())
