"""The ``disagg`` command line and local mode."""
