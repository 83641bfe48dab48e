"""An agent written with the OpenAI Agents SDK (``pip install 'centerline[agents]'``), played as an
environment: ``centerline up --environment examples.agents_sdk:adder`` (README, "Environments").

The SDK's default model speaks the Responses API, which the session endpoint does not serve; its
chat-completions model class, ``OpenAIChatCompletionsModel``, given the session's client (an
``openai.AsyncOpenAI`` whose base URL is the session's), speaks the endpoint's chat completions.
Every model call of the run is one turn of the session: the tokens trained are the ones SGLang
sampled, the tool's results are injected between turns, untrained.
"""

from __future__ import annotations

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

set_tracing_disabled(True)  # the SDK would otherwise send its traces to OpenAI's servers


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def adder(client, task) -> float:
    """The agent answers ``task.prompt`` with the add tool at hand; the reward is 1 if its final
    answer holds ``task.answer``."""
    agent = Agent(
        name="adder",
        instructions="Answer with the sum. Use the add tool.",
        tools=[add],
        model=OpenAIChatCompletionsModel(model="default", openai_client=client),
        model_settings=ModelSettings(max_tokens=48),
    )
    result = await Runner.run(agent, task.prompt, max_turns=3)
    return 1.0 if task.answer in str(result.final_output) else 0.0
