"""What sites compute on their own data and send the server, beyond their weights.

* :mod:`.rounds`: a statistics round's messages, the sufficient statistics of one level
  (:class:`~.rounds.StatisticsRequest`, :class:`~.rounds.SiteStatistics`);
* :mod:`.on_site`: how a site computes them on its own data (:func:`~.on_site.site_statistics`);
* :mod:`.channels`: how the server reaches the sites (:class:`~.channels.SiteChannel`,
  :class:`~.channels.LocalSites`) and checks their replies;
* :mod:`.readings`: how the server reads each site's neurons as fused neurons;
* :mod:`.summed_terms` and :mod:`.fixed_point`: fits that need only sums over sites, and their
  fixed-point units for secure aggregation;
* :mod:`.privacy`: per-sample clipping and Gaussian noise on what a site sends;
* :mod:`.budget`: a privacy budget spread over all of a fusion's releases, and its account;
* :mod:`.grams`: the Gram matrices of each level's inputs (RegMean and kin, one upload);
* :mod:`.fisher`: the diagonal Fisher or K-FAC factors (Fisher merging, FedFisher, one upload);
* :mod:`.class_gaussians`: each class's mean and PPCA covariance, which complete a skewed
  fusion set.
"""
