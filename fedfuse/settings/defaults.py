"""Run defaults that the command line shows, in a module that imports nothing heavy.

``fedfuse speed`` builds its argument parser from these, so that parsing a command line imports
no PyTorch; :mod:`fedfuse.settings.run` imports them and keeps their names.
"""

from __future__ import annotations

#: samples in the server's fusion set (run config ``fusion-samples``, Hydra
#: ``fusion_set.samples``; the paper's 400)
DEFAULT_FUSION_SAMPLES = 400
