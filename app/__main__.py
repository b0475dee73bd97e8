"""`python -m app ...`: see app/cli.py."""

from app.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
