"""`python -m ft_jax ...` is the `ft-jax` command line (see ft_jax.cli)."""

from ft_jax.cli import console_main

console_main()
