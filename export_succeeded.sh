#!/usr/bin/env bash
# Succeeded attempts only -> results_succeeded.csv. Extra args: -d DB, -o CSV.
here=$(cd "$(dirname "$0")" && pwd)
python=${CODESIGN_PYTHON:-python3}
[ -z "${CODESIGN_PYTHON:-}" ] && [ -x "$here/.venv/bin/python" ] && python=$here/.venv/bin/python
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m codesign.export succeeded "$@"
