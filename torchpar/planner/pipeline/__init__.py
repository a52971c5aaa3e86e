"""Pipelines in the planner (Alpa's inter-operator pass): operator clustering into layers (:mod:`.layers`), the stage
DP over submeshes (:mod:`.stages`, its analytic stage costs :mod:`.stage_cost`, interleaved stages
:mod:`.interleaved_stages`, submesh shapes :mod:`.submeshes`), cutting the graph into stage graphs (:mod:`.slicing`),
the schedules both the DP and the runtime read (:mod:`.schedules`), the micro-batch count search
(:mod:`.micro_batch_counts`) and the door that prices the best partitions with the sharding ILP
(:mod:`.pipeline_plan`)."""
