"""This repository's deployable service: a thin shell over the `cronlock` library.

`python -m app ...` and `uvicorn --factory app.main:create_app` in a checkout do what
`python -m cronlock ...` and `cronlock.service:create_app` do; the wheel ships `cronlock` alone.
"""
