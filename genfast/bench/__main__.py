"""`python -m genfast.bench ROW.json`: one row of a `genfast bench` ladder, in a fresh process."""

import sys

from genfast.bench.ladder import main

sys.exit(main(sys.argv[1:]))
