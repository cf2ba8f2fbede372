"""Methods that choose among the other fusion methods: ``auto`` (:mod:`.auto`)."""
