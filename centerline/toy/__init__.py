"""The toy model and its tasks: what `centerline up` trains when no ``--model`` or ``--dataset`` is
given.

- ``dataset.py``: the toy tasks' problems and datasets (``centerline dataset``).
- ``tokenizer.py``: the byte-level tokenizer of the toy model.
- ``model_init.py``: the toy model, written as an HF directory (``centerline init-model``).
- ``sft.py``: its warm start on a task (``init-model --sft``).
"""
