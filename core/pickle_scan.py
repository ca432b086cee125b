"""What a pickle asks for, read without running it: the globals it names and the calls it
makes, as far as its opcodes spell them out.

core/checkpoint.py asks this before torch reads a file, so that a refused file is named by
everything it asks for (torch names the first global it refuses, and of a pickle in a
protocol it does not read, none), and a file is refused before any of it runs when it
would call something that allocates what its own bytes do not hold (`bytearray(10**9)`
from a few bytes). The opcodes are only parsed (Python's pickletools): no object is made,
no global imported.
"""
from __future__ import annotations

import io
import pickletools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Global:
    """A global the pickle pushes: `module.name`."""
    name: str


class _Unknown:
    """A value the scan does not follow (a list, a dict, the result of a call)."""


UNKNOWN, _MARK = _Unknown(), object()
_LITERALS = {"int", "int_or_bool", "bytes", "bytes_or_str", "str", "bytearray", "float"}


@dataclass
class Scan:
    names: list[str] = field(default_factory=list)   # every global named, once, in order
    calls: list[tuple[str, tuple]] = field(default_factory=list)   # (global called, its arguments)

    def name(self, name: str) -> Global:
        if name not in self.names:
            self.names.append(name)
        return Global(name)


def scan(data: bytes, pickles: int = 1) -> Scan:
    """The globals and calls of the first `pickles` pickles in `data` (torch's older format
    writes five in a row; a plain pickle is one). Arguments are kept where the pickle spells
    them as literals (ints, strings, bytes, tuples of these); anything else is UNKNOWN. A
    stream that stops being a pickle ends the scan with what was found so far."""
    found, stream = Scan(), io.BytesIO(data)
    for _ in range(pickles):
        try:
            _scan_one(stream, found)
        except (ValueError, IndexError, KeyError, EOFError):   # not (or no longer) a pickle
            break
    return found


def _scan_one(stream, found: Scan) -> None:
    stack: list = []
    memo: dict = {}
    for op, arg, _ in pickletools.genops(stream):
        name = op.name
        if name == "STOP":
            return
        if name == "MARK":
            stack.append(_MARK)
        elif name in ("GLOBAL", "INST"):
            g = found.name(arg.replace(" ", "."))
            if name == "INST":
                found.calls.append((g.name, tuple(_to_mark(stack))))
            stack.append(g if name == "GLOBAL" else UNKNOWN)
        elif name == "STACK_GLOBAL":
            attr, module = stack.pop(), stack.pop()
            text = isinstance(attr, str) and isinstance(module, str)
            stack.append(found.name(f"{module}.{attr}" if text else "<a global the pickle computes>"))
        elif name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX"):
            if name == "NEWOBJ_EX":
                stack.pop()   # its keyword arguments
            args = stack.pop()
            _call(found, stack.pop(), args if isinstance(args, tuple) else (UNKNOWN,))
            stack.append(UNKNOWN)
        elif name == "OBJ":
            items = _to_mark(stack)
            _call(found, items[0], tuple(items[1:]))
            stack.append(UNKNOWN)
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(arg, UNKNOWN))
        elif name.startswith("EXT"):
            stack.append(found.name(f"<copyreg extension {arg}>"))
        elif name == "DUP":
            stack.append(stack[-1])
        elif name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE"):
            n = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "EMPTY_TUPLE": 0}.get(name)
            items = _to_mark(stack) if n is None else [stack.pop() for _ in range(n)][::-1]
            stack.append(tuple(items))
        else:
            _generic(op, arg, stack)


def _call(found: Scan, func, args: tuple) -> None:
    if isinstance(func, Global):
        found.calls.append((func.name, args))


def _generic(op, arg, stack: list) -> None:
    """Any other opcode by its stack effect: what it takes off, and a literal or UNKNOWN for
    what it leaves."""
    for before in reversed(op.stack_before):
        if before is pickletools.stackslice:
            continue
        if before is pickletools.markobject:
            _to_mark(stack)
        else:
            stack.pop()
    for after in op.stack_after:
        stack.append(arg if after.name in _LITERALS and arg is not None else UNKNOWN)


def _to_mark(stack: list) -> list:
    """The items above the topmost mark, the mark taken off too."""
    items = []
    while (item := stack.pop()) is not _MARK:
        items.append(item)
    return items[::-1]
