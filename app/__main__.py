"""`python -m app ...` in a checkout: the `cronlock` command line."""

from cronlock.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
