"""Run one task and record how it ended: `python -I launcher.py EXIT_FILE -- CMD...`.

The agent starts this wrapper in a new session, so a task outlives an agent that is
killed, and a restarted agent can re-adopt it by its pid and read its exit from the
file. A stop is a SIGTERM to the whole process group (the task gets it too); the
wrapper itself waits for the task. Standard library only: it starts in milliseconds.
"""

import json
import os
import signal
import subprocess
import sys


def main() -> int:
    exit_file, sep, *cmd = sys.argv[1:]
    if sep != "--" or not cmd:
        print("usage: launcher.py EXIT_FILE -- CMD...", file=sys.stderr)
        return 2
    try:
        child = subprocess.Popen(cmd)
    except OSError as e:
        print(f"gpuorch: cannot start {cmd[0]!r}: {e.strerror}", file=sys.stderr)
        result = {"code": 127, "reason": f"cannot start {cmd[0]}: {e.strerror}"}
    else:
        signal.signal(signal.SIGTERM, lambda *_: None)  # the group got it: wait for the task to exit
        rc = child.wait()
        result = {"code": rc} if rc >= 0 else {"signal": -rc}
    tmp = exit_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, exit_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
