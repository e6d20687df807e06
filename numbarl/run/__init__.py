"""The experiment harness: the trainer behind ``numbarl-train``, the run folder (atomic writes,
resume), the report and the seed-sweep comparison. It drives the learner in ``numbarl.rl``; the
learner never imports it (SPEC §2: cli -> run -> rl -> env -> cuda)."""
