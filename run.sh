#!/usr/bin/env bash
# Run codesign and restart it when it exits abnormally (a crash, a killed orchestrator).
# Every argument is passed on. A usage or config error (exit 2), a clean finish (0), a finished
# sweep in which some jobs failed (3), Ctrl-C (130) or SIGTERM (143) stops the loop; SIGINT and
# SIGTERM sent to this script are passed on to codesign, which kills its running jobs and
# records them before it exits. At most
# CODESIGN_MAX_RESTARTS restarts (default 5).
set -u
python=$(dirname "$0")/scripts/python.sh
max_restarts=${CODESIGN_MAX_RESTARTS:-5}
restarts=0
child=
stopped=  # the exit code of a stop asked for by a signal: 130 (INT) or 143 (TERM)
pass_on() {
    stopped=$2
    [ -n "$child" ] && kill "-$1" "$child" 2>/dev/null
}
trap 'pass_on INT 130' INT
trap 'pass_on TERM 143' TERM
while true; do
    "$python" -m codesign "$@" &
    child=$!
    wait "$child"
    code=$?
    if [ -n "$stopped" ]; then  # wait returned for the signal: let codesign finish, exit as it did
        while kill -0 "$child" 2>/dev/null; do wait "$child"; done
        wait "$child"
        exit $?
    fi
    case $code in
        0 | 2 | 3 | 130 | 143) exit "$code" ;;
    esac
    if [ "$restarts" -ge "$max_restarts" ]; then
        echo "run.sh: codesign exited with $code; gave up after $restarts restarts" >&2
        exit "$code"
    fi
    restarts=$((restarts + 1))
    echo "run.sh: codesign exited with $code; restart $restarts of $max_restarts" >&2
    sleep "${CODESIGN_RESTART_DELAY:-2}" &
    wait $!
    [ -n "$stopped" ] && exit "$stopped"
done
