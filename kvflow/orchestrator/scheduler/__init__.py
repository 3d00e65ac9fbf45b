"""The scheduler: which tokens of which requests run in the next step. Pure Python.

One room per job:

* ``core.py``: the :class:`Scheduler` base: the queues, requests in and out, the step's frame,
  the sampled tokens back (``update_from_output``), append and fork, the counters and
  ``check_integrity``;
* ``admission.py``: whether a request may be queued (bad request, overload, and the SLO
  queue-delay prediction);
* ``deadlines.py``: timeouts;
* ``preemption.py``: which running request gives way, and swap or recompute;
* ``policies.py``: the admission order of the waiting queue (fcfs, priority, sjf, ...);
* ``continuous.py``: continuous batching under a token budget (every queue policy);
* ``step_budget.py``: the token budget from a target step time and the measured step costs;
* ``static.py``: static batching, the baseline;
* ``registry.py``: the class for each policy name (``SCHEDULERS``, ``make_scheduler``);
* ``output.py``: the step's handoff objects (``SchedulerOutput``, ``RunnerOutput``).

The registry is not imported here, so that importing one room does not load them all.
"""
