"""`python -m forgetting_transformer ...`: the `fox` command line (see forgetting_transformer.cli)."""
import sys

from .cli import console_main

if __name__ == "__main__":
    sys.exit(console_main())
