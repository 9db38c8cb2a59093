"""Engines do not survive ``fork``: the child gets a copy of the engine's memory but none of its
threads (worker, callback thread) and shares the parent's provider state. Using an inherited
engine would queue work that never completes, so it raises ``EngineStoppedError`` naming fork.

Each process has a fork generation, bumped in the child after every fork; an engine remembers
the generation it was created in. The child also keeps inherited native engines alive for good,
even through interpreter shutdown: dropping one would wait for threads that do not exist in the
child (and its teardown would act on provider state the parent still uses).
"""

from __future__ import annotations

import ctypes
import os
import weakref
from typing import Any, Generic, TypeVar, cast, overload

from .errors import EngineStoppedError

_generation = 0
_live: weakref.WeakSet[Any] = weakref.WeakSet()  # owners of guarded native objects


def generation() -> int:
    """The fork generation of this process (0 in a process that was not forked from one using
    fabric_lib)."""
    return _generation


def _after_fork_in_child() -> None:
    global _generation
    _generation += 1
    for owner in list(_live):
        forget = getattr(owner, "_after_fork_in_child", None)
        if forget is not None:
            forget()  # e.g. drop the owner's stop-at-exit finalizer
        entry = owner.__dict__.get("_fork_guarded")
        if entry is not None:
            # One reference nobody releases: not even shutdown's clean-up may drop the native.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(entry[0]))


os.register_at_fork(after_in_child=_after_fork_in_child)


def check(created_in: int, creator_pid: int, what: str = "engine") -> None:
    """Raises EngineStoppedError if the object was created before a fork into this process."""
    if created_in != _generation:
        raise EngineStoppedError(
            f"this {what} was created in process {creator_pid} and this process ({os.getpid()}) is a "
            "child forked from it: its worker threads do not survive fork. Create the engine in the "
            "child, or start children with multiprocessing's 'spawn' or 'forkserver' method."
        )


T = TypeVar("T")


class ForkGuarded(Generic[T]):
    """A data descriptor holding an object's native engine, refused in a forked child."""

    def __set__(self, owner: Any, native: T) -> None:
        owner.__dict__["_fork_guarded"] = (native, _generation, os.getpid())
        _live.add(owner)

    @overload
    def __get__(self, owner: None, owner_type: type | None = None) -> ForkGuarded[T]: ...
    @overload
    def __get__(self, owner: object, owner_type: type | None = None) -> T: ...
    def __get__(self, owner: object, owner_type: type | None = None) -> T | ForkGuarded[T]:
        if owner is None:
            return self
        native, created_in, creator_pid = owner.__dict__["_fork_guarded"]
        if created_in != _generation:  # inline test: this runs on every submit
            check(created_in, creator_pid)
        return cast(T, native)


def inherited(owner: Any) -> bool:
    """True if ``owner``'s native engine was created before a fork into this process."""
    entry = owner.__dict__.get("_fork_guarded")
    return entry is not None and entry[1] != _generation
