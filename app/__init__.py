"""cronlock: scheduled jobs that run exactly once across instances sharing one PostgreSQL primary."""

__version__ = "0.1.0"
