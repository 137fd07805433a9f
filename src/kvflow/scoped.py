"""A value put in scope for the code inside a `with`, the way `torch.device(...)` puts a device in
scope, and read where it is needed: the tensor-parallel group and the pipeline stage a model is
built for, the kernels it is built with. Construction code reads it once and keeps it; nothing
threads it through every constructor."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Generic, TypeVar

T = TypeVar("T")


class Scoped(Generic[T]):
    def __init__(self, name: str, default: T) -> None:
        self._var: ContextVar[T] = ContextVar(name, default=default)

    @contextmanager
    def scope(self, value: T) -> Iterator[T]:
        token = self._var.set(value)
        try:
            yield value
        finally:
            self._var.reset(token)

    def current(self) -> T:
        """The value in scope; outside any scope, the default."""
        return self._var.get()
