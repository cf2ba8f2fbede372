"""The fusion methods, one module each, grouped by family as the literature groups them.

* :mod:`.averaging`: coordinate-wise averages, plain (vanilla, FedAvg) or weighted by each
  site's Fisher information (Fisher merging, FedFisher);
* :mod:`.matching`: align the models' neurons one to one (or by transport), then average:
  FedMA/PFNM, OTFusion, Git Re-Basin, ZipIt!, CCA Merge;
* :mod:`.neuron_interpolation`: the paper's K-means and Hungarian Fusion, fitted on the fusion
  set (Linear, Gradient), on the sites' own data (statistics rounds), on their Grams, or row by
  row to the models that know each label (trust);
* :mod:`.regression`: RegMean and its fusion-set anchored kin: each level refitted to every
  site's outputs through Gram matrices;
* :mod:`.trained`: the references that train on the fusion set (knowledge distillation, linear
  probing, DENSE) and FS-Merge;
* :mod:`.selection`: ``auto``, which fuses with several of the above and keeps the best on
  held-out fusion rows.

Every method subclasses :class:`fedfuse.fusion.base.FusionMethod` and registers itself by name
(:mod:`fedfuse.fusion.registry`); the shared math is in :mod:`fedfuse.fusion.blocks`.
"""
