"""Tools for multi-turn rollouts: the contract and parsing (`base`), and built-ins looked up by name."""

from __future__ import annotations

from shardrl.tools.base import (CALL_END, CALL_START, DaemonThreadPool, Tool, ToolCall, call_tool, check_arguments,
                                parse_tool_call, parse_tool_calls, run_tool_calls)
from shardrl.tools.calculator import CalculatorTool, evaluate_arithmetic
from shardrl.tools.python_exec import PythonTool, run_python

BUILTIN_TOOLS: dict[str, type[Tool]] = {"calculator": CalculatorTool, "python": PythonTool}

__all__ = ["BUILTIN_TOOLS", "CALL_END", "CALL_START", "CalculatorTool", "DaemonThreadPool", "PythonTool", "Tool",
           "ToolCall", "call_tool", "check_arguments", "evaluate_arithmetic", "parse_tool_call", "parse_tool_calls", "run_python",
           "run_tool_calls"]
