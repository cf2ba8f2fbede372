"""What the server asks of a site besides its weights and importance scores, as one value.

The server derives it once from its fusion methods' needs
(:func:`fedfuse.federation.method_needs.upload_request_for`) and sends it with the train message
and the check before training (``clients/records.py`` encodes it). A site computes and sends
exactly what it says, and its policy judges exactly what it says: the site never rebuilds the
server's methods to learn what to send.

This module imports nothing of fedfuse, so that reading a request leads nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

#: how the statistics rounds after the upload are answered: not at all (""), one site's
#: statistics at a time ("rounds"), or as shares of a sum the server sees only whole
#: ("secure-sums", secure aggregation); the names are the site policy's statistics kinds
ROUND_KINDS = ("", "rounds", "secure-sums")


@dataclass(frozen=True)
class UploadRequest:
    """What a site sends besides its weights and scores (the default: nothing more).

    Attributes:
        grams: upload the Gram matrices of each level's inputs (RegMean and its kin read them).
        fisher: the Fisher kinds to upload (``"diagonal"``, ``"kfac"``; empty: none).
        gaussian_rank: upload the site's class Gaussians with covariances of this rank (0:
            none; the server completes its fusion set from them).
        rounds: the statistics rounds the run asks after the upload, one of
            :data:`ROUND_KINDS` (the site's policy judges them before it trains).
    """

    grams: bool = False
    fisher: tuple[str, ...] = ()
    gaussian_rank: int = 0
    rounds: str = ""

    def __post_init__(self) -> None:
        """Refuse a malformed request at once, naming the field."""
        if not isinstance(self.grams, bool):
            raise TypeError(f"UploadRequest.grams must be a bool, got {self.grams!r}")
        if not isinstance(self.fisher, tuple) or not all(isinstance(k, str) for k in self.fisher):
            raise TypeError(f"UploadRequest.fisher must be a tuple of names, got {self.fisher!r}")
        rank = self.gaussian_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(
                f"UploadRequest.gaussian_rank must be a whole number >= 0, got {rank!r}"
            )
        if self.rounds not in ROUND_KINDS:
            raise ValueError(
                f"UploadRequest.rounds must be one of {ROUND_KINDS}, got {self.rounds!r}"
            )

    def statistics(self) -> frozenset[str]:
        """The statistics kinds this request asks of the site, as the site's policy names them
        (:data:`fedfuse.federation.policy.STATISTICS_KINDS`)."""
        kinds = {self.rounds} if self.rounds else set()
        if self.grams:
            kinds.add("grams")
        if self.fisher:
            kinds.add("fisher")
        if self.gaussian_rank:
            kinds.add("class-gaussians")
        return frozenset(kinds)
