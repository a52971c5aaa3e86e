"""The Ray runtime: the cluster torchpar connects to (:mod:`.ray_cluster`), one actor per host (:mod:`.host_actor`)
driven by :mod:`.ray_executor`, and the direct channels between actors (:mod:`.channels`)."""
