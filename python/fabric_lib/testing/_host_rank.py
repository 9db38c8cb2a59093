"""Entry point of a rank on a test-bed host: ``python -m fabric_lib.testing._host_rank FD``
(started by ``ranks.host_ranks`` inside the host's network namespace)."""

from __future__ import annotations

import os
import sys

from fabric_lib.testing.ranks import serve_host

if __name__ == "__main__":
    serve_host(int(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # do not wait at exit for threads that libraries (gloo, torch) leave running
