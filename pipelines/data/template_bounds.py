"""Chat templates render under a bound: transformers compiles every chat template in `BoundedSandbox`, its own
sandbox (`ImmutableSandboxedEnvironment`) with Jinja's documented extension points used to keep a render's time
and memory bounded, so a hostile template is one line (`TemplateLimitError`, which the chat code names with the
record), never a process that grows without end.

Per render (one conversation, or its first turns):
- steps: every loop iteration and every call (a macro, a method, a global, a filter) is one step; at most
  MAX_RENDER_STEPS. Nested loops, recursive macros and doubling loops run out of steps.
- sizes: no value a template makes (`*`, `+`, `%`, `~`, a call's or a filter's result) and not its output may hold
  more than MAX_RENDER_CHARS characters (items, for a list); a product, or a width (an integer argument of a string
  method or a filter, a width or precision in a `%` or `str.format` format), that would exceed it is refused before
  it is computed, an integer power over MAX_INT_BITS too. `'x' * n` is never folded into a constant
  at compile time (the operators are intercepted), so a huge literal product is refused when rendered.

`install()` puts the sandbox in place of transformers' (the name its chat template compiler looks up), once per
process, before any template is compiled.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.environment import Template
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from preinfer.errors import UsageError

MAX_RENDER_STEPS = 1 << 20  # loop iterations and calls of one render
MAX_RENDER_CHARS = 1 << 24  # characters (or list items) of any value a render makes, and of its output
MAX_INT_BITS = 4096  # the largest integer a template may compute by a power or a product
# The widths and precisions of a `%` format (`%-*.3f`) and of a `str.format` field (`{:>80}`, `{0:.{1}}`).
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_NUMBER = re.compile(r"\d+")


class TemplateLimitError(SecurityError, UsageError):
    """A render went over one of the bounds (steps, sizes) of `BoundedSandbox`: a refusal of the sandbox's kind
    (Jinja's SecurityError), and bad input of ours (a chat template that cannot be used)."""


class Budget:
    """The steps and output characters one render has used."""

    def __init__(self) -> None:
        self.steps = 0
        self.chars = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_RENDER_STEPS:
            raise TemplateLimitError(f"the template ran over {MAX_RENDER_STEPS:,} steps (loop iterations and calls) "
                                     f"in one render")

    def output(self, text: str) -> str:
        self.chars += len(text)
        if self.chars > MAX_RENDER_CHARS:
            raise TemplateLimitError(f"the template's output is over {MAX_RENDER_CHARS:,} characters")
        return text


_STATE = threading.local()


def budget() -> Budget:
    """The budget of the render in progress on this thread."""
    if getattr(_STATE, "budget", None) is None:
        _STATE.budget = Budget()
    return _STATE.budget


def _fresh_budget() -> Budget:
    _STATE.budget = Budget()
    return _STATE.budget


def _too_large(size: int) -> TemplateLimitError:
    return TemplateLimitError(f"the template makes a value of {size:,} characters (or items), over the "
                              f"{MAX_RENDER_CHARS:,} a render may hold")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def checked(value: Any) -> Any:
    """`value`, refused when it holds more than MAX_RENDER_CHARS characters or items."""
    if _size(value) > MAX_RENDER_CHARS:
        raise _too_large(_size(value))
    return value


def _check_widths(args: Iterable[Any]) -> None:
    """Refuse an integer argument too large for any width or count a render may use."""
    for value in args:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RENDER_CHARS:
            raise TemplateLimitError(f"the template asks for a width or count of {value:,}, over the "
                                     f"{MAX_RENDER_CHARS:,} a render may use")


def _check_percent(template: str, args: Any) -> None:
    """Refuse `template % args` whose widths or precisions (given, or `*` taken from `args`) are too large."""
    specs = [part for spec in _PERCENT_SPEC.findall(template) for part in spec if part]
    _check_widths(int(part) for part in specs if part != "*")
    if "*" in specs:
        _check_widths(args if isinstance(args, tuple) else [args])


def _check_format(template: str) -> None:
    """Refuse a `str.format` template whose fields' widths or precisions are too large."""
    fields = (field.partition(":")[2] for field in re.findall(r"\{([^{}]*)", template))
    _check_widths(int(number) for spec in fields for number in _FORMAT_NUMBER.findall(spec))


def _check_product(left: Any, right: Any) -> None:
    """Refuse `left * right` when its result would be over the bounds."""
    for sequence, count in ((left, right), (right, left)):
        if _size(sequence) and isinstance(count, int) and _size(sequence) * max(count, 0) > MAX_RENDER_CHARS:
            raise _too_large(_size(sequence) * count)
    if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"the template multiplies integers over {MAX_INT_BITS} bits")


def _check_power(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        if exponent * math.log2(abs(base)) > MAX_INT_BITS:
            raise TemplateLimitError(f"the template raises {base} to the power {exponent:,}, over {MAX_INT_BITS} "
                                     f"bits")


class _Bounding(NodeTransformer):
    """Every loop's iterable counted one step per item, every `~` concatenation's result checked."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("counted"), [node.iter], [], None, None,
                               lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(nodes.EnvironmentAttribute("checked"), [node], [], None, None, lineno=node.lineno)


class BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, after `_Bounding` has rewritten the template."""

    def visit_Template(self, node: nodes.Template, frame: Any = None) -> None:
        super().visit_Template(_Bounding().visit(node), frame)


class BoundedTemplate(Template):
    """A template whose every render starts a fresh `Budget`, and whose streamed output is counted too."""

    def render(self, *args: Any, **kwargs: Any) -> str:
        _fresh_budget()
        return super().render(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[str]:
        spent = _fresh_budget()
        for text in super().generate(*args, **kwargs):
            yield spent.output(text)


def _bounded_filter(function: Any, percent: bool) -> Any:
    """A filter whose width and count arguments (and, for `format`, its value's `%` format) and whose result are
    checked, one step per use."""

    @functools.wraps(function)  # keeps Jinja's pass_context / pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget().step()
        _check_widths([*args[1:], *kwargs.values()])
        if percent and args and isinstance(args[0], str):
            _check_percent(args[0], tuple(args[1:]))
        return checked(function(*args, **kwargs))

    return bounded


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat template sandbox with every render bounded (see the module)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = BoundedCodeGenerator
    template_class = BoundedTemplate

    def from_string(self, source: Any, globals: Any = None, template_class: Any = None) -> Template:
        """Compile `source` with every filter bounded (transformers adds its own before it compiles)."""
        self.filters = {name: _bounded_filter(function, name == "format") for name, function in self.filters.items()}
        return super().from_string(source, globals, template_class)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget().step()
        if operator == "*":
            _check_product(left, right)
        elif operator == "**":
            _check_power(left, right)
        elif operator == "+" and _size(left) + _size(right) > MAX_RENDER_CHARS:
            raise _too_large(_size(left) + _size(right))
        elif operator == "%" and isinstance(left, str):
            _check_percent(left, right)
        return checked(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (as Jinja's)
        budget().step()
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)  # the sandbox wraps str.format
        if isinstance(owner, str) and getattr(__obj, "__name__", "") in ("format", "format_map"):
            _check_format(owner)  # its arguments are values; its fields' widths are in the string
        elif isinstance(owner, str):  # another string method: its integers are widths and counts
            _check_widths([*args, *kwargs.values()])
        return checked(ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs))

    def concat(self, parts: Iterable[str]) -> str:
        """A render's output, counted as it is joined."""
        spent = budget()
        return "".join(spent.output(part) for part in parts)

    def counted(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """The items of a loop's iterable, one step each."""
        spent = budget()
        for item in iterable:
            spent.step()
            yield item

    def checked(self, value: Any) -> Any:
        return checked(value)


@functools.cache
def install() -> None:
    """Make transformers compile chat templates in `BoundedSandbox` (once per process; templates it compiled before
    are compiled again)."""
    from transformers.utils import chat_template_utils

    chat_template_utils.ImmutableSandboxedEnvironment = BoundedSandbox
    chat_template_utils._compile_jinja_template.cache_clear()
