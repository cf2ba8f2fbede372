"""Experiments built on the Flower-free core: ``compare`` (Hydra sweeps of fusion methods over
partition configs), ``report`` (their tables and figures), ``speed`` and ``scale``.

Submodules are imported on use (``from fedfuse.experiments import compare``), so
``python -m fedfuse.experiments.report.document`` runs the module cleanly.
"""
