"""`python -m tests.fault_cli ARGS`: the codesign command line whose jobs run `tests.fault_jobs`
and whose device profile is `tests.fault_profile`.

The same process as `python -m codesign` (config, store, sweep, signals, exit codes); only the
job body and the profiler are fake ones, so fault trials cost a fraction of a second per job.
"""

import sys

from codesign import cli
from codesign.cli.session import Session
from codesign.run import profile_cache
from codesign.run.local import LocalExecutor

if __name__ == "__main__":
    Session.executor = lambda self, options: LocalExecutor(
        job_module="tests.fault_jobs", cpu_slots=options.max_concurrent or 1, stream=options.verbose)
    profile_cache.PROFILE_MODULE = "tests.fault_profile"
    sys.exit(cli.main())
