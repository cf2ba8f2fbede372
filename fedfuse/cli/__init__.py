"""The ``fedfuse`` command line: one module per command family, ``main`` dispatches."""
