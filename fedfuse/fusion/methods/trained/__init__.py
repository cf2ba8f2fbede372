"""Methods that train a model by gradient descent on the fusion set (or on generated rows):
knowledge distillation and linear probing (:mod:`.distillation`), DENSE's data-free
distillation (:mod:`.dense`) and FS-Merge's foldable SuperNet (:mod:`.fs_merge`). The ensemble
teacher, the distillation loss, the fit and the student's start they share are in
:mod:`.teaching`."""
