"""Matching, then averaging: each model's neurons are aligned to a reference (or to global
neurons) before the parameters are averaged. FedMA-style PFNM matching (:mod:`.fedma`, its
BBP-MAP in :mod:`.fedma_bbp`), OTFusion (:mod:`.otfusion`, its transport step in
:mod:`.otfusion_transport`), Git Re-Basin (:mod:`.git_rebasin`, its matching step in
:mod:`.git_rebasin_matching`), ZipIt! (:mod:`.zipit`) and CCA Merge (:mod:`.cca_merge`).
OTFusion and Git Re-Basin share their options, capture, averaging and finish
(:mod:`.aligned_average`)."""
