"""Matching, then averaging: each model's neurons are aligned to a reference (or to global
neurons) before the parameters are averaged. FedMA-style PFNM matching (:mod:`.fedma`, its
BBP-MAP in :mod:`.fedma_bbp`), OTFusion (:mod:`.otfusion`), Git Re-Basin (:mod:`.git_rebasin`),
ZipIt! (:mod:`.zipit`) and CCA Merge (:mod:`.cca_merge`)."""
