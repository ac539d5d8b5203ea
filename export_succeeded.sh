#!/usr/bin/env bash
# Succeeded attempts only -> results_succeeded.csv. Extra args: -d DB, -o CSV.
exec "$(dirname "$0")/scripts/python.sh" -m codesign export succeeded "$@"
