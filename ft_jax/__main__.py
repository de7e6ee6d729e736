"""`python -m ft_jax ...` is the `ft-jax` command line (see ft_jax.cli)."""

import sys

from ft_jax.cli import main

sys.exit(main())
