"""Environment switches for side-by-side benchmarks: the op and the modules read their FOX_*
switches at each call, so one process can time a switch against the default."""
import contextlib
import os


def parse(switch):
    """"VAR=VALUE" -> (VAR, VALUE)."""
    name, sep, value = switch.partition("=")
    if not sep or not name:
        raise ValueError(f"a switch is VAR=VALUE, got {switch!r}")
    return name, value


@contextlib.contextmanager
def environment(name, value):
    """The variable set to value inside the block, restored (or removed) after it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
