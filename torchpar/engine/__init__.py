"""The Engine's rooms: what :class:`torchpar.api.Engine` delegates to. The road it walks once per batch signature
(:mod:`.compiled`), the link to the torch model and optimizer (:mod:`.torch_side`, :mod:`.model_link`,
:mod:`.grad_stand_in`), the checks around each step (:mod:`.guard`, :mod:`.diagnosis`), batches and host-loaded data
(:mod:`.batches`, :mod:`.feeding`, :mod:`.host_arrays`), its read-only views and checkpoints
(:mod:`.engine_readouts`, :mod:`.engine_checkpoints`), and measurement around planning (:mod:`.profiled`,
:mod:`.machine_constants`)."""
