"""`centerline up`'s wing: the whole system on one machine, one module per job.

- ``launcher.py``: the command, ``main`` and the run in order (prepare, NATS, engines, router,
  proxy, workers, trainer, report).
- ``run_spec.py``: the run's settings object, ``RunSpec``, which ``up``, ``centerline experiment``
  and ``centerline bench pipeline`` take; ``parse`` reads ``up``'s flags into it.
- ``prepare.py`` and ``user_task.py``: what a run trains and evaluates, the toy task or your own.
- ``processes.py``: the processes, started, watched, restarted and stopped (the benches that start
  SGLang servers use it too).
- ``console.py``: what ``up`` shows as it runs.

Nothing imports ``launcher.py``: a job that runs ``up`` (the experiment, the pipeline bench) writes
its spec to a file and starts ``centerline up --config FILE``.
"""
