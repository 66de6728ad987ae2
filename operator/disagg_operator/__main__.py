"""`python -m disagg_operator [--namespace NS ...]`: the same as `disagg operator`."""

import sys

from disagg_operator.commands import operator_main

sys.exit(operator_main(sys.argv[1:]))
