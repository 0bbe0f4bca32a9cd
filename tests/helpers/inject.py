"""Run `preinfer ARGS` with faults injected at the code's own phases (not at times):

    python tests/helpers/inject.py SPEC [SPEC ...] -- ARGS

SPEC is `module:qualified.name@when[#n]=action`: at the n-th call (1: the first) of that function, `before` it runs
or `after` it returns, do `action`: `exit` (the process dies at once, as under SIGKILL: os._exit(137), nothing
flushed or cleaned up), `enospc` (raise OSError(ENOSPC) naming the function), or `pause:DIR` (create DIR/held, then
wait until DIR/go exists: the test runs a second job meanwhile). `forked` runs the same in a child forked from the
calling process."""

import errno
import functools
import importlib
import os
import sys
import time
from pathlib import Path


def act(action: str, where: str) -> None:
    if action == "exit":
        os._exit(137)
    if action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where)
    if action.startswith("pause:"):
        directory = Path(action.removeprefix("pause:"))
        (directory / "held").write_text(str(os.getpid()))
        while not (directory / "go").exists():
            time.sleep(0.05)
        return
    raise SystemExit(f"inject: unknown action {action!r}")


def patch(spec: str, rebind: bool = False) -> None:
    """Install `spec`'s wrapper; with `rebind`, also in place of every name an imported module holds the function
    by (`from module import name` run before the patch, as in a forked child)."""
    target, action = spec.split("=", 1)
    target, when = target.split("@")
    when, _, nth = when.partition("#")
    module_name, qualname = target.split(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    calls = {"n": 0}
    wanted = int(nth or 1)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        calls["n"] += 1
        hit = calls["n"] == wanted
        if hit and when == "before":
            act(action, qualname)
        result = original(*args, **kwargs)
        if hit and when == "after":
            act(action, qualname)
        return result

    setattr(owner, name, wrapper)
    for module in list(sys.modules.values()) if rebind else ():
        for key, value in list(vars(module).items()):
            if value is original:
                setattr(module, key, wrapper)


def forked(specs: list[str], argv: list[str], log: Path) -> int:
    """`preinfer ARGV` with `specs` injected, in a child forked from this process (its modules already imported:
    no interpreter start-up), its stdout and stderr written to `log`; the child's exit code (137: killed by `exit`).
    The child ends with os._exit: nothing of this process (a test runner's hooks, atexit) runs in it."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            sys.stdout = sys.stderr = open(out, "w", buffering=1, closefd=False)
            for spec in specs:
                patch(spec, rebind=True)
            from pipelines.cli import main as cli

            code = cli(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def main() -> int:
    split = sys.argv.index("--")
    for spec in sys.argv[1:split]:
        patch(spec)
    from pipelines.cli import main as cli

    return cli(sys.argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
