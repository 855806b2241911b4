"""Parse, without running, `python -m MODULE ARGS...` commands: a JSON list of [MODULE, ARG...] on
stdin, a JSON list of [argv, error or null] on stdout. Each module runs as __main__ until its
first ArgumentParser.parse_args() returns, then stops (tests/test_readme_commands.py)."""
import argparse
import contextlib
import io
import json
import runpy
import sys


class _Parsed(BaseException):
    """Raised once a module's arguments parsed: it stops the module before it runs."""


_orig = argparse.ArgumentParser.parse_args


def _parse_args(self, args=None, namespace=None):
    _orig(self, args, namespace)
    raise _Parsed()


argparse.ArgumentParser.parse_args = _parse_args
out = []
for argv in json.load(sys.stdin):
    mod, args = argv[0], argv[1:]
    sys.argv = [mod] + args
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_module(mod, run_name="__main__", alter_sys=True)
        out.append([argv, "ran without parsing"])
    except _Parsed:
        out.append([argv, None])
    except SystemExit as e:
        out.append([argv, f"exit {e.code}: {err.getvalue().strip()[-300:]}"])
    except Exception as e:  # noqa: BLE001 - reported as this command's failure
        out.append([argv, f"{type(e).__name__}: {e}"])
print(json.dumps(out))
