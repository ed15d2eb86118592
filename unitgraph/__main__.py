"""`python -m unitgraph ...`: the same command as `unitgraph ...` (for a Python whose scripts folder is not on PATH)."""

from unitgraph.cli.app import main

if __name__ == "__main__":
    main()
