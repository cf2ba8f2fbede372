"""Regression merges: each level refitted, in closed form, to the outputs of every site's model
through Gram matrices. RegMean (:mod:`.regmean`; its least-squares systems in
:mod:`.regmean_systems`, its fit from sums over sites in :mod:`.regmean_sums`) and RegMean
anchored on the server's labelled fusion set (:mod:`.regmean_fusion_set`); the sites' Grams are
computed in :mod:`fedfuse.fusion.statistics.grams`."""
