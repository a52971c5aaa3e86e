"""Measurement on this machine's devices: stages and collectives timed (:mod:`.profiler`), this machine's cost
constants (:mod:`.calibration`), and the disk cache that keeps both (:mod:`.profile_cache`)."""
