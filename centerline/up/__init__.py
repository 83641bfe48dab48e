"""`centerline up`'s wing: the whole system on one machine (``launcher.py``), the run spec it
composes (``run_spec.py``) and the user's own task it prepares (``user_task.py``)."""
