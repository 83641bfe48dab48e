"""The refusals of a session turn (docs/design.md section 12): one family, ``SessionError``, whose
``code`` the chat endpoint answers with and whose ``fatal`` says whether the task can still be trained
(``rollout_worker/session.py``)."""

from __future__ import annotations


class SessionError(ValueError):
    """A turn the session refuses; ``code`` names the family for the chat endpoint's error, ``fatal``
    says whether the session can still be trained whole (docs/design.md section 12)."""

    code = "session_error"
    fatal = True


class SessionHistoryError(SessionError):
    """The messages do not extend the session's history (a past message edited, reordered or dropped)."""

    code = "session_history"
    fatal = False  # nothing was added to the session: it holds its complete turns


class SessionTemplateError(SessionError):
    """The chat template fails to render the conversation, or its rendering does not extend the tokens
    the session holds; the same template renders the same on every attempt."""

    code = "session_template"


class SessionRequestError(SessionError):
    """A request that is not a chat-completions request (a field of the wrong type, a message without a role)."""

    code = "invalid_request"


class UnsupportedSettingError(SessionError):
    """A request setting the endpoint does not honour: the run's sampling is the one trained on."""

    code = "unsupported_setting"


class SessionBudgetError(SessionError):
    """The turn could take the session past its token budget; the session has ended."""

    code = "context_length_exceeded"  # OpenAI's code, which chat clients already handle
    fatal = False  # the session ends after its last complete turn, which is trained
