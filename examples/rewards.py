"""The reward of the README's "Train your own model": ``--reward examples.rewards:contains_answer``."""


def contains_answer(text: str, task) -> float:
    """text: the response, its stop token cut off; task.prompt, task.answer, task.meta: the row's."""
    return 1.0 if task.answer.lower() in text.lower() else 0.0
