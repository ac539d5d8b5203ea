#!/usr/bin/env bash
# Every finished attempt (with a result or an error) -> results_all.csv. Extra args: -d DB, -o CSV.
exec "$(dirname "$0")/scripts/python.sh" -m codesign export all "$@"
