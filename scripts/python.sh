#!/usr/bin/env bash
# The Python the repository's scripts run with: $CODESIGN_PYTHON, else the checkout's .venv,
# else python3; the checkout itself first on PYTHONPATH. Every argument is passed on.
root=$(cd "$(dirname "$0")/.." && pwd)
python=${CODESIGN_PYTHON:-python3}
[ -z "${CODESIGN_PYTHON:-}" ] && [ -x "$root/.venv/bin/python" ] && python=$root/.venv/bin/python
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" "$@"
