"""PyTorch's semantics that a plain ``torch.export`` loses, kept while a step is captured: where autograd stops a
gradient (:mod:`.grad_semantics`), custom ``autograd.Function`` backwards (:mod:`.autograd_functions`), gradients
taken inside the step (:mod:`.inner_gradients`), activation checkpointing (:mod:`.remat`), cumulative
BatchNorm (:mod:`.batch_norm`), ``torch.distributions`` (:mod:`.distributions`) and constant attention masks folded
into fused attention (:mod:`.attention_masks`)."""
