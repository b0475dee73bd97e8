"""The service's ASGI factory, as the Dockerfile and a checkout name it: cronlock's own."""

from cronlock.service import create_app

__all__ = ["create_app"]
