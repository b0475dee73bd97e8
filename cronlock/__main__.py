"""`python -m cronlock ...`: see cronlock/cli/main.py."""

from cronlock.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
