"""What sites compute on their own data and send the server, beyond their weights.

* :mod:`.rounds`: the sufficient statistics of one level for a statistics round
  (:class:`~.rounds.StatisticsRequest`, :func:`~.rounds.site_statistics`,
  :class:`~.rounds.LocalSites`);
* :mod:`.readings`: how the server reads each site's neurons as fused neurons;
* :mod:`.summed_terms` and :mod:`.fixed_point`: fits that need only sums over sites, and their
  fixed-point units for secure aggregation;
* :mod:`.privacy`: per-sample clipping and Gaussian noise on what a site sends;
* :mod:`.grams`: the Gram matrices of each level's inputs (RegMean and kin, one upload);
* :mod:`.class_gaussians`: each class's mean and PPCA covariance, which complete a skewed
  fusion set.
"""
