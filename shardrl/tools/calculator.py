"""A calculator tool: arithmetic on numbers, evaluated by walking Python's AST (never `eval`)."""

from __future__ import annotations

import ast
import math
import operator

from shardrl.tools.base import Tool

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
"""`a ** b` with |b| above this is refused: 9 ** 9 ** 9 would take the process's memory."""
MAX_MAGNITUDE = 1e100
MAX_LENGTH = 500


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic `expression` (+ - * / // % **, parentheses, int and float literals);
    ValueError on anything else (names, calls, attributes, huge powers, division by zero)."""
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("the result is not a real number of a sensible size")
        return value
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


def format_number(value: int | float) -> str:
    """12.0 -> "12", 0.1 + 0.2 -> "0.3" (12 significant digits), 7 -> "7"."""
    if isinstance(value, float):
        if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


class CalculatorTool(Tool):
    name = "calculator"
    description = "Evaluates an arithmetic expression (+ - * / // % ** and parentheses) and returns its value."
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string", "description": "e.g. \"(12 + 5) * 3\""}},
                  "required": ["expression"]}

    def call(self, args: dict) -> str:
        try:
            return format_number(evaluate_arithmetic(args["expression"]))
        except ValueError as e:
            return f"error: {e}"
