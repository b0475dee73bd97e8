"""cronlock's version, as pyproject.toml gives it. Its own module, so that modules inside the
package can name it without importing `cronlock/__init__.py`, which only re-exports."""

__version__ = "0.2.0"
