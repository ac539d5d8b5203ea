#!/usr/bin/env bash
# Run codesign and restart it when it exits abnormally (a crash, a killed orchestrator).
# Every argument is passed on. A usage or config error (exit 2), a clean finish (0) or a
# user's Ctrl-C (130) stops the loop; at most CODESIGN_MAX_RESTARTS restarts (default 5).
set -u
python=$(dirname "$0")/scripts/python.sh
max_restarts=${CODESIGN_MAX_RESTARTS:-5}
restarts=0
while true; do
    "$python" -m codesign "$@"
    code=$?
    case $code in
        0 | 2 | 130) exit "$code" ;;
    esac
    if [ "$restarts" -ge "$max_restarts" ]; then
        echo "run.sh: codesign exited with $code; gave up after $restarts restarts" >&2
        exit "$code"
    fi
    restarts=$((restarts + 1))
    echo "run.sh: codesign exited with $code; restart $restarts of $max_restarts" >&2
    sleep "${CODESIGN_RESTART_DELAY:-2}"
done
