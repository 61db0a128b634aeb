"""`python -m powerd.cli`: the `powerd` command, as the installed script runs it."""

import sys

from powerd.cli import main

sys.exit(main())
