"""Child side of `sglang_support.run_scripts` (see _subproc.py): one interpreter that
imports the heavy modules once, then runs each script in a process forked from it.

IN holds (preload, scripts): module names to import first, and a list of
(env, code) pairs. For each script the forked child applies its environment changes
(a value of None removes the variable), sends its stdout and stderr to files, and runs
the code as ``python -c`` would (an uncaught SystemExit with a message prints it and
exits 1; any other exception prints its traceback and exits 1). OUT receives, per
script, (exit status, stdout, stderr).
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import tempfile
import traceback


def _run_child(env: dict[str, str | None], code: str, out_path: str, err_path: str) -> int:
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    out_fd = os.open(out_path, os.O_WRONLY | os.O_TRUNC)
    err_fd = os.open(err_path, os.O_WRONLY | os.O_TRUNC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    status = 0
    try:
        exec(compile(code, "<script>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        if exc.code is None:
            status = 0
        elif isinstance(exc.code, int):
            status = exc.code
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return status


def main(inp: str, out: str) -> None:
    with open(inp, "rb") as f:
        preload, scripts = pickle.load(f)
    for name in preload:
        importlib.import_module(name)
    results = []
    with tempfile.TemporaryDirectory(prefix="sglang-forker-") as tmp:
        for i, (env, code) in enumerate(scripts):
            out_path, err_path = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
            for path in (out_path, err_path):
                open(path, "w").close()
            pid = os.fork()
            if pid == 0:  # the script's process: never returns into this loop
                status = 1
                try:
                    status = _run_child(env, code, out_path, err_path)
                finally:
                    os._exit(status)
            _, wait_status = os.waitpid(pid, 0)
            with open(out_path, errors="replace") as o, open(err_path, errors="replace") as e:
                results.append((os.waitstatus_to_exitcode(wait_status), o.read(), e.read()))
    with open(out, "wb") as f:
        pickle.dump(results, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
