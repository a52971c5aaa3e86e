"""One-stage plans (every method but a pipeline): the fused training step and eval forward on one mesh, as GSPMD
programs (:mod:`.programs`) or per-device ``shard_map`` programs (:mod:`.spmd_step`), and where they put every pinned
tensor (:mod:`.placement`)."""
