"""Command lines that start specstep's own child processes (the scheduler process, a server for a sweep).

`python -m pkg.mod` puts the current directory first on `sys.path`, so a checkout or a stray `specstep/` folder
where the user happens to stand would be imported instead of the installed code. The children start with `-c`
instead and drop that entry before importing anything of ours: they run exactly what the parent imported (same
interpreter, same site-packages and PYTHONPATH), whatever the working directory holds.
"""

from __future__ import annotations

import sys

_BOOT = ("import sys, runpy\n"
         "if sys.path and sys.path[0] in ('', '.'): del sys.path[0]\n"
         "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")


def module_command(module: str, *args: str) -> list[str]:
    """argv that runs `module` as `__main__` with `args`, never importing from the current directory."""
    return [sys.executable, "-c", _BOOT.format(module=module), *args]
