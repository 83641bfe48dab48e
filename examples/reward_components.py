"""Two rewards weighted together (docs/extending.md, "A reward"):
``--reward examples.reward_components:judged=1.0 --reward examples.reward_components:brevity=0.5``."""


async def judged(text: str, task) -> float:
    """An async reward (an LLM judge through an async client, say) is awaited; this one judges by hand."""
    return 1.0 if text.strip().lower().startswith(task.answer.lower()) else 0.0


def brevity(text: str, task) -> float:
    """A plain reward runs in the worker's thread pool (worker.reward_threads), off its event loop."""
    return 1.0 if len(text) <= 2 * len(task.answer) else 0.0
