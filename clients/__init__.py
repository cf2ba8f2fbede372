"""Client side (one per site): fedfuse's ``ClientApp``, and the one call any Flower ClientApp
makes to send what some fusion methods read from the sites (:func:`add_fusion_extras`)."""

from fedfuse.clients.extras import add_fusion_extras, requested_extras

__all__ = ["add_fusion_extras", "requested_extras"]
