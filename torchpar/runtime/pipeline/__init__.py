"""Pipelines: each stage's compiled programs (:mod:`.stage_program`, with ZB-H1's split backward,
:mod:`.split_backward`), the interpreter running a device group's instruction list (:mod:`.interpreter`), values
moved between stages (:mod:`.transport`), gradients finished across stages (:mod:`.gradients`) and the measured step's
timeline (:mod:`.timeline`)."""
