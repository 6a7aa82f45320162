"""Pure output parsers: reasoning blocks and tool calls in a model's reply, streamed or not."""

from pypto_serving.parsers.reasoning import (
    REASONING_PARSER_NAMES,
    ReasoningDelta,
    ReasoningFormat,
    ReasoningParser,
    ThinkParser,
    reasoning_parser_for,
)
from pypto_serving.parsers.tool_calls import (
    TOOL_PARSER_NAMES,
    ContentDelta,
    HermesToolParser,
    ToolCall,
    ToolCallDelta,
    ToolCallError,
    ToolEvent,
    ToolOutcome,
    ToolParser,
    new_call_id,
    tool_parser_for,
    tool_parser_name,
)

__all__ = [
    "REASONING_PARSER_NAMES", "TOOL_PARSER_NAMES", "ContentDelta", "HermesToolParser", "ReasoningDelta",
    "ReasoningFormat", "ReasoningParser", "ThinkParser", "ToolCall", "ToolCallDelta", "ToolCallError",
    "ToolEvent", "ToolOutcome", "ToolParser", "new_call_id", "reasoning_parser_for", "tool_parser_for",
    "tool_parser_name",
]
