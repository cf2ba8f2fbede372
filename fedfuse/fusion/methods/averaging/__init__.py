"""Averaging the models' parameters coordinate by coordinate: vanilla and FedAvg
(:mod:`.fedavg`), and averages weighted by each site's Fisher information (:mod:`.fisher`)."""
