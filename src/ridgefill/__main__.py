"""`python -m ridgefill` runs the CLI."""

from ridgefill.cli import main

main()
