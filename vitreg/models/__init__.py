"""Model families (:mod:`~vitreg.models.families`), building a model (:mod:`~vitreg.models.factory`),
FLOPs (:mod:`~vitreg.models.flops`) and memory floors (:mod:`~vitreg.models.memory`)."""
