"""Helpers that several rooms share and that are no job of their own: child processes
(:mod:`.procs`) and the argument types of the commands (:mod:`.args`)."""
