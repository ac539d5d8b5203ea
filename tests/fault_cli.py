"""`python -m tests.fault_cli ARGS`: the codesign command line whose jobs run `tests.fault_jobs`.

The same process as `python -m codesign` (config, store, sweep, signals, exit codes); only the
job body is the fake one, so fault trials cost a fraction of a second per job.
"""

import sys

from codesign import cli
from codesign.run.local import LocalExecutor

if __name__ == "__main__":
    cli._executor = lambda db, address: LocalExecutor(job_module="tests.fault_jobs")
    sys.exit(cli.main())
