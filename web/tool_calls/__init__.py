"""Tool calling over the chat template: families of call formats, the grammar for constrained calls, and a
streaming parser of calls out of generated text. Text in, text out: no engine state (web/ only)."""

from web.tool_calls.formats import FunctionTool, ToolFormat, detect_tool_format
from web.tool_calls.parser import ArgumentsPiece, ParsedCall, ToolCallHeader, ToolCallParser
from web.tool_calls.request import ToolPlan, plan_tools

__all__ = [
    "ArgumentsPiece",
    "FunctionTool",
    "ParsedCall",
    "ToolCallHeader",
    "ToolCallParser",
    "ToolFormat",
    "ToolPlan",
    "detect_tool_format",
    "plan_tools",
]
