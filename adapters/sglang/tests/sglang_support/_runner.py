"""Child side of `sglang_support.run_in_python` (see _subproc.py)."""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback


def main(inp: str, out: str) -> None:
    try:
        with open(inp, "rb") as f:
            target, args, kwargs = pickle.load(f)
        mod_name, _, fn_name = target.partition(":")
        fn = getattr(importlib.import_module(mod_name), fn_name)
        result = ("ok", fn(*args, **kwargs))
    except BaseException:
        result = ("err", traceback.format_exc())
    try:
        data = pickle.dumps(result)
    except Exception:
        data = pickle.dumps(("err", f"result not picklable:\n{traceback.format_exc()}"))
    with open(out, "wb") as f:
        f.write(data)
    sys.stdout.flush()
    sys.stderr.flush()
    # A NIXL manager's bootstrap thread is not a daemon: do not wait for threads.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
