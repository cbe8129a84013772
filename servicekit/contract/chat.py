"""What a chat turn must be, checked where it enters (the SDK before sending, the gateway on receipt)."""

from __future__ import annotations

from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.prompt import check_text

CHAT_ROLES = ("system", "user", "assistant")  # the turns chat templates take
WIRE_ROLES = (*CHAT_ROLES, "tool")  # generation.proto ChatMessage.role: a tool turn is a call's result


def check_chat_message(index: int, role, content, roles: tuple[str, ...] = CHAT_ROLES) -> None:
    """One chat turn as the gateway takes it: a known role and text (may be empty, as in OpenAI's API:
    an assistant turn that ended at once, an empty system prompt). Raises
    InvalidArgumentError naming the field (``messages[1].role``); the SDK and the gateway both
    check with this, so a turn the SDK builds is one the gateway accepts."""
    if not isinstance(role, str) or role not in roles:
        raise InvalidArgumentError(f"messages[{index}].role", f"must be one of {', '.join(roles)}; got {role!r}")
    if not isinstance(content, str):
        raise InvalidArgumentError(f"messages[{index}].content", "required: a string")
    check_text(f"messages[{index}].content", content)
