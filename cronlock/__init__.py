"""cronlock: scheduled jobs that run exactly once across instances sharing one primary."""

__version__ = "0.1.0"
